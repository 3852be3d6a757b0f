"""The head -> worker step message: a SchedulerOutput packed in fixed-width fields.

Workers keep per-slot state (block tables, recurrent-state slots) between steps,
so a step carries only what changed: per scheduled request its slot, state slot,
start position, the tokens fed, the block ids appended this step, and (once, when
it starts or resumes) its sampling parameters; plus the ids of requests that left,
and the KV blocks and snapshot rows whose pages go back to the OS (each rank's own).
A steady decode step is therefore O(batch) bytes whatever the context length.
Positions and ids are fixed-width int32 (not pickled varints) so that holds
exactly, byte for byte. Prompt token ids of new requests are not sent: workers
never sample, and the tokens they compute on arrive in `token_ids` chunks.
Pickle is used only for the rare sampling parameters.

Layout (little-endian):
    header   u32 n_scheduled, u32 n_decode_tokens, u32 n_prefill_tokens, u32 n_released,
             u32 n_released_blocks, u32 n_released_rows
    released n_released x (u16 length, utf-8 request id), n_released_blocks x i32, n_released_rows x i32
    request  i32 slot, i32 start, i32 state_slot (-1 none), i32 restore_snapshot (-1 none),
             u32 n_tokens, u32 n_new_blocks, u16 n_snapshot_writes, u16 id length, u8 flags
             (1 sample, 2 new, 4 prompt logits, 8 speculative), id, n_tokens x i32, n_new_blocks x i32,
             writes x (i32, i32), if new: u32 length, pickled SamplingParams; if prompt logits: u32
             num_prompt_logits; if speculative: u16 num_draft, u16 n_draft_state_rows, i32 rollback_state_row
             (-1 none), n_draft_state_rows x i32
"""

from __future__ import annotations

import pickle
import struct
from array import array

from pagellm.core.types import NewRequestData, ScheduledRequest, SchedulerOutput

_HEADER = struct.Struct("<IIIIII")
_REQUEST = struct.Struct("<iiiiIIHHB")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_SPECULATIVE = struct.Struct("<HHi")
# prompt logits: only prompt_logprobs requests pay the 4 bytes; speculative: only verify items and rollbacks theirs
_SAMPLE, _NEW, _PROMPT_LOGITS, _DRAFTS = 1, 2, 4, 8


def encode_step(output: SchedulerOutput) -> bytes:
    parts = [_HEADER.pack(len(output.scheduled), output.num_decode_tokens, output.num_prefill_tokens,
                          len(output.released_request_ids), len(output.released_blocks),
                          len(output.released_snapshot_rows))]
    for request_id in output.released_request_ids:
        raw = request_id.encode()
        parts += [_U16.pack(len(raw)), raw]
    parts += [array("i", output.released_blocks).tobytes(), array("i", output.released_snapshot_rows).tobytes()]
    for item in output.scheduled:
        raw = item.request_id.encode()
        speculative = item.num_draft or item.rollback_state_row is not None
        flags = ((_SAMPLE if item.sample else 0) | (_NEW if item.new is not None else 0)
                 | (_PROMPT_LOGITS if item.num_prompt_logits else 0) | (_DRAFTS if speculative else 0))
        parts.append(_REQUEST.pack(item.slot, item.start_position, _or_minus_one(item.state_slot),
                                   _or_minus_one(item.restore_snapshot), len(item.token_ids),
                                   len(item.new_block_ids), len(item.snapshot_writes), len(raw), flags))
        parts += [raw, array("i", item.token_ids).tobytes(), array("i", item.new_block_ids).tobytes(),
                  array("i", [v for pair in item.snapshot_writes for v in pair]).tobytes()]
        if item.new is not None:
            params = pickle.dumps(item.new.sampling_params, protocol=pickle.HIGHEST_PROTOCOL)
            parts += [_U32.pack(len(params)), params]
        if item.num_prompt_logits:
            parts.append(_U32.pack(item.num_prompt_logits))
        if speculative:
            parts += [_SPECULATIVE.pack(item.num_draft, len(item.draft_state_rows),
                                        _or_minus_one(item.rollback_state_row)),
                      array("i", item.draft_state_rows).tobytes()]
    return b"".join(parts)


def decode_step(data: bytes) -> SchedulerOutput:
    view = memoryview(data)
    n_scheduled, n_decode, n_prefill, n_released, n_blocks_out, n_rows_out = _HEADER.unpack_from(view, 0)
    offset = _HEADER.size
    released = []
    for _ in range(n_released):
        request_id, offset = _read_str(view, offset)
        released.append(request_id)
    released_blocks, offset = _read_ints(view, offset, n_blocks_out)
    released_rows, offset = _read_ints(view, offset, n_rows_out)
    scheduled = []
    for _ in range(n_scheduled):
        slot, start, state_slot, restore, n_tokens, n_blocks, n_writes, id_len, flags = _REQUEST.unpack_from(view, offset)
        offset += _REQUEST.size
        request_id = bytes(view[offset : offset + id_len]).decode()
        offset += id_len
        tokens, offset = _read_ints(view, offset, n_tokens)
        blocks, offset = _read_ints(view, offset, n_blocks)
        flat_writes, offset = _read_ints(view, offset, 2 * n_writes)
        new = None
        if flags & _NEW:
            (length,) = _U32.unpack_from(view, offset)
            params = pickle.loads(view[offset + 4 : offset + 4 + length])
            offset += 4 + length
            new = NewRequestData((), (), params)
        num_prompt_logits = num_draft = 0
        if flags & _PROMPT_LOGITS:
            (num_prompt_logits,) = _U32.unpack_from(view, offset)
            offset += _U32.size
        draft_rows, rollback = (), -1
        if flags & _DRAFTS:
            num_draft, n_rows, rollback = _SPECULATIVE.unpack_from(view, offset)
            draft_rows, offset = _read_ints(view, offset + _SPECULATIVE.size, n_rows)
        scheduled.append(ScheduledRequest(
            request_id, slot, tokens, start, blocks, bool(flags & _SAMPLE), new,
            None if state_slot < 0 else state_slot, None if restore < 0 else restore,
            tuple(zip(flat_writes[::2], flat_writes[1::2])), num_prompt_logits, num_draft, draft_rows,
            None if rollback < 0 else rollback))
    if offset != len(data):
        raise ValueError(f"step message has {len(data) - offset} trailing bytes")
    return SchedulerOutput(tuple(scheduled), tuple(released), n_decode, n_prefill,
                           released_blocks=released_blocks, released_snapshot_rows=released_rows)


def _or_minus_one(value: int | None) -> int:
    return -1 if value is None else value


def _read_str(view: memoryview, offset: int) -> tuple[str, int]:
    (length,) = _U16.unpack_from(view, offset)
    start = offset + _U16.size
    return bytes(view[start : start + length]).decode(), start + length


def _read_ints(view: memoryview, offset: int, count: int) -> tuple[tuple[int, ...], int]:
    end = offset + 4 * count
    values = array("i")  # 4-byte ints on every platform we build for
    values.frombytes(view[offset:end])
    return tuple(values), end
