// The model's answers as Markdown: parsed by marked, fenced code highlighted by highlight.js, the HTML sanitized by
// DOMPurify, then copy buttons added. The three libraries are vendored in static/vendor (see its README.md) and
// loaded before this file as the globals `marked`, `hljs` and `DOMPurify`.
"use strict";

const escapeHTML = (text) => text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

// What marked produces from Markdown (highlight.js adds spans), and nothing else: no images or media (an answer
// must not make the browser fetch anything, e.g. a URL carrying the conversation), no forms, no inline styles.
const SANITIZE = {
  ALLOWED_TAGS: ["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre",
    "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td", "span"],
  ALLOWED_ATTR: ["href", "title", "class", "align", "start"],
  ALLOW_DATA_ATTR: false, ALLOW_ARIA_ATTR: false, RETURN_DOM_FRAGMENT: true,
};
// highlight.js's classes ("hljs-title function_") and marked's "language-x" only: an answer cannot dress itself
// up as the page's own parts (a "copy" button, an "error" message).
const OWN_CLASS = /^(hljs|language-)|_$/;

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.hasAttribute("class")) {
    const kept = node.getAttribute("class").split(/\s+/).filter((name) => OWN_CLASS.test(name));
    if (kept.length) node.setAttribute("class", kept.join(" "));
    else node.removeAttribute("class");
  }
  if (node.tagName === "A") {  // a link opens beside the conversation instead of replacing it
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

// Highlighting guesses the language of an unlabelled block only once the answer is complete: guessing tries every
// bundled language, too slow to redo on every frame of a stream.
let guessLanguages = false;
// highlight.js's score of a guess; below it a short snippet is called "ini" or "properties" as readily as anything
const GUESS_MIN_RELEVANCE = 5;

// The block's HTML and the language it was highlighted as (none: shown as plain text)
function highlight(text, lang) {
  if (lang && hljs.getLanguage(lang)) {
    return {html: hljs.highlight(text, {language: lang, ignoreIllegals: true}).value, language: lang};
  }
  if (!lang && guessLanguages && text.trim()) {
    const guess = hljs.highlightAuto(text);
    if (guess.language && guess.relevance >= GUESS_MIN_RELEVANCE) {
      return {html: guess.value, language: guess.language};
    }
  }
  return {html: escapeHTML(text), language: lang};
}

const markdown = new marked.Marked({gfm: true, breaks: true}, {  // a model's newline is meant as one
  renderer: {
    code({text, lang}) {
      const name = (lang || "").trim().split(/\s+/)[0].toLowerCase();
      const {html, language} = highlight(text.replace(/\n$/, ""), name);
      const label = language ? ` language-${escapeHTML(language)}` : "";
      return `<pre><code class="hljs${label}">${html}</code></pre>\n`;
    },
    // Raw HTML in an answer is shown as the text the model wrote, as a chat shows it; DOMPurify stays behind it
    html({text}) { return escapeHTML(text); },
    image({href, text}) { return `<a href="${escapeHTML(href || "")}">${escapeHTML(text || href || "image")}</a>`; },
    checkbox({checked}) { return checked ? "\u2611 " : "\u2610 "; },
  },
});

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  // over plain http from another machine the Clipboard API is absent: the older selection-and-command way
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  const copied = document.execCommand("copy");
  area.remove();
  return copied ? Promise.resolve() : Promise.reject(new Error("copy refused"));
}

// Each highlighted <pre> gets a bar with its language and a copy button, built with the DOM after sanitizing
function decorateCode(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const label = document.createElement("span");
    const lang = code && [...code.classList].find((name) => name.startsWith("language-"));
    label.textContent = lang ? lang.slice("language-".length) : "code";
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    bar.append(label, button);
    const block = document.createElement("div");
    block.className = "code-block";
    pre.replaceWith(block);
    block.append(bar, pre);
  }
}

// One click listener for every copy button, present and future: buttons are rebuilt while an answer streams
document.addEventListener("click", (event) => {
  const button = event.target.closest && event.target.closest("button.copy");
  if (!button) return;
  const code = button.closest(".code-block").querySelector("code");
  copyText(code.textContent).then(() => { button.textContent = "Copied"; },
    () => { button.textContent = "Copy failed"; });
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});

function renderBlock(token) {
  const fragment = DOMPurify.sanitize(markdown.parser([token]), SANITIZE);
  decorateCode(fragment);
  const block = document.createElement("div");
  block.className = "md-block";
  block.source = token.raw;  // what it was rendered from: an unchanged block is kept as it is
  block.append(fragment);
  return block;
}

// The answer in one element, re-rendered at most once per animation frame while chunks arrive. The text is split
// into top-level blocks (paragraphs, lists, code fences ...) and only blocks whose source changed are rebuilt, so
// the finished part of an answer stays still (no flicker, a selection or a copy button in it survives) and only
// the growing last block changes. An unclosed fence is a code block running to the end, as CommonMark says.
class AnswerView {
  constructor(element, asMarkdown) {
    this.element = element;
    this.asMarkdown = asMarkdown;  // false: a text continuation, shown as it is
    this.text = "";
    this.frame = 0;
    if (asMarkdown) element.classList.add("markdown");
  }

  update(text) {
    this.text = text;
    if (!this.frame) this.frame = requestAnimationFrame(() => { this.frame = 0; this.render(false); });
  }

  // The last render, at once; it also rebuilds what only the whole answer decides: blocks that use a reference
  // link defined further down, and code with no language, whose language is now guessed.
  finish(text) {
    this.stop();
    this.text = text;
    this.render(true);
  }

  stop() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
  }

  render(complete) {
    if (!this.asMarkdown) {
      this.element.textContent = this.text;
    } else {
      guessLanguages = complete;
      try {
        this.renderBlocks(complete);
      } catch (error) {  // whatever marked cannot parse is still shown, as text, until a render succeeds
        const plain = document.createElement("div");
        plain.className = "md-block plain";
        plain.textContent = this.text;
        this.element.replaceChildren(plain);
      } finally {
        guessLanguages = false;
      }
    }
    (this.element.parentElement || this.element).scrollIntoView({block: "end"});
  }

  renderBlocks(complete) {
    const tokens = markdown.lexer(this.text);
    const relink = complete && Object.keys(tokens.links || {}).length > 0;
    const blocks = tokens.filter((token) => token.type !== "space");
    const old = [...this.element.children];
    blocks.forEach((token, i) => {
      const guess = complete && token.type === "code" && !token.lang;
      if (old[i] && old[i].source === token.raw && !relink && !guess) return;
      const block = renderBlock(token);
      if (old[i]) old[i].replaceWith(block);
      else this.element.appendChild(block);
    });
    old.slice(blocks.length).forEach((block) => block.remove());
  }
}
