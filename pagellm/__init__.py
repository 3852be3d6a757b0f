"""pagellm: an LLM inference and serving engine with a paged KV cache."""

from pagellm.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in torch and transformers; import it lazily so `import pagellm` stays cheap.
    if name == "LLM":
        from pagellm.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
