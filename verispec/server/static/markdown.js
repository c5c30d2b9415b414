// A small, safe Markdown subset for untrusted model output.
//
// Every piece of model text reaches the page through document.createTextNode, never through
// innerHTML, so "<script>" in a reply is just eight characters. Supported: fenced code blocks
// (with a copy button; an unclosed fence while streaming is still a code block), headings, lists,
// block quotes, rules, paragraphs, `code`, **bold**, *italic* and [links](https://only).
//
// Each text node is cut from the source by offset, so the caller's "drafted" character ranges
// (which characters came from accepted draft tokens) can tint exactly those characters.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])( *\1){2,} *$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+/;
const QUOTE = /^ {0,3}> ?/;
const SAFE_LINK = /^https?:\/\/[^\s<>"']+$/;

// Splits text into lines with their offsets: [{start, end}] where end excludes the newline.
function splitLines(text) {
  const lines = [];
  let start = 0;
  while (start <= text.length) {
    const nl = text.indexOf("\n", start);
    const end = nl === -1 ? text.length : nl;
    lines.push({ start, end });
    if (nl === -1) break;
    start = nl + 1;
  }
  return lines;
}

class Renderer {
  constructor(text, draftedRanges, onCopy) {
    this.text = text;
    this.ranges = draftedRanges || [];
    this.onCopy = onCopy;
  }

  // Appends source characters [start, end) to parent, drafted ones inside <span class="drafted">.
  appendText(parent, start, end) {
    let at = start;
    // binary search for the first range ending after start: a long reply has thousands of ranges
    let lo = 0;
    let hi = this.ranges.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.ranges[mid][1] <= start) lo = mid + 1;
      else hi = mid;
    }
    for (let k = lo; k < this.ranges.length; k++) {
      const [a, b] = this.ranges[k];
      if (a >= end) break;
      if (a > at) parent.appendChild(document.createTextNode(this.text.slice(at, a)));
      const span = document.createElement("span");
      span.className = "drafted";
      span.textContent = this.text.slice(Math.max(a, at), Math.min(b, end));
      parent.appendChild(span);
      at = Math.min(b, end);
    }
    if (at < end) parent.appendChild(document.createTextNode(this.text.slice(at, end)));
  }

  line(l) { return this.text.slice(l.start, l.end); }

  render() {
    const root = document.createDocumentFragment();
    const lines = splitLines(this.text);
    let i = 0;
    while (i < lines.length) {
      const line = this.line(lines[i]);
      if (!line.trim()) { i++; continue; }
      const fence = FENCE.exec(line);
      if (fence) { i = this.codeBlock(root, lines, i, fence); continue; }
      const heading = HEADING.exec(line);
      if (heading) {
        const h = document.createElement("h" + Math.min(heading[1].length + 2, 6));
        const offset = lines[i].start + line.indexOf(heading[2], heading[1].length);
        this.inline(h, offset, offset + heading[2].length);
        root.appendChild(h);
        i++;
        continue;
      }
      if (RULE.test(line)) { root.appendChild(document.createElement("hr")); i++; continue; }
      if (QUOTE.test(line)) { i = this.quote(root, lines, i); continue; }
      if (LIST_ITEM.test(line)) { i = this.list(root, lines, i); continue; }
      i = this.paragraph(root, lines, i);
    }
    return root;
  }

  startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
  }

  codeBlock(root, lines, i, fence) {
    const marker = fence[1];
    let j = i + 1;
    while (j < lines.length) {
      const candidate = this.line(lines[j]).trim();
      // a closing fence: only the opening fence's character, at least as many of them
      if (candidate.length >= marker.length && [...candidate].every((c) => c === marker[0])) break;
      j++;
    }
    const start = i + 1 < lines.length ? lines[i + 1].start : lines[i].end;
    const end = j - 1 > i ? lines[j - 1].end : start;
    const block = document.createElement("div");
    block.className = "code-block";
    const head = document.createElement("div");
    head.className = "code-head";
    const lang = document.createElement("span");
    lang.textContent = fence[2] || "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    const source = this.text.slice(start, end);
    copy.addEventListener("click", () => this.onCopy(source, copy));
    head.append(lang, copy);
    const pre = document.createElement("pre");
    const code = document.createElement("code");
    this.appendText(code, start, end);
    pre.appendChild(code);
    block.append(head, pre);
    root.appendChild(block);
    return j + 1;  // past the closing fence (or the end: an unclosed fence runs to the end)
  }

  quote(root, lines, i) {
    const quote = document.createElement("blockquote");
    let first = true;
    while (i < lines.length && QUOTE.test(this.line(lines[i]))) {
      const prefix = QUOTE.exec(this.line(lines[i]))[0].length;
      if (!first) quote.appendChild(document.createElement("br"));
      this.inline(quote, lines[i].start + prefix, lines[i].end);
      first = false;
      i++;
    }
    root.appendChild(quote);
    return i;
  }

  list(root, lines, i) {
    const ordered = /\d/.test(LIST_ITEM.exec(this.line(lines[i]))[2]);
    const list = document.createElement(ordered ? "ol" : "ul");
    let item = null;
    while (i < lines.length) {
      const line = this.line(lines[i]);
      const match = LIST_ITEM.exec(line);
      if (match && /\d/.test(match[2]) === ordered) {
        item = document.createElement("li");
        this.inline(item, lines[i].start + match[0].length, lines[i].end);
        list.appendChild(item);
      } else if (item && line.trim() && /^\s/.test(line) && !FENCE.test(line)) {
        item.appendChild(document.createElement("br"));  // an indented continuation line
        const indent = line.length - line.trimStart().length;
        this.inline(item, lines[i].start + indent, lines[i].end);
      } else {
        break;
      }
      i++;
    }
    root.appendChild(list);
    return i;
  }

  paragraph(root, lines, i) {
    const p = document.createElement("p");
    let first = true;
    while (i < lines.length) {
      const line = this.line(lines[i]);
      if (!line.trim() || (!first && this.startsBlock(line))) break;
      if (!first) p.appendChild(document.createElement("br"));
      this.inline(p, lines[i].start, lines[i].end);
      first = false;
      i++;
    }
    root.appendChild(p);
    return i;
  }

  // Inline spans within source [start, end): `code`, **bold**, *italic*, [text](https://url).
  inline(parent, start, end) {
    const text = this.text;
    let plainFrom = start;
    let at = start;
    const flush = (upTo) => { if (upTo > plainFrom) this.appendText(parent, plainFrom, upTo); };
    while (at < end) {
      const ch = text[at];
      let handled = 0;
      if (ch === "`") {
        const close = text.indexOf("`", at + 1);
        if (close !== -1 && close < end && close > at + 1) {
          flush(at);
          const code = document.createElement("code");
          this.appendText(code, at + 1, close);
          parent.appendChild(code);
          handled = close + 1;
        }
      } else if (ch === "*" && text[at + 1] === "*") {
        const close = text.indexOf("**", at + 2);
        if (close !== -1 && close + 2 <= end && close > at + 2) {
          flush(at);
          const strong = document.createElement("strong");
          this.inline(strong, at + 2, close);
          parent.appendChild(strong);
          handled = close + 2;
        }
      } else if (ch === "*" && at + 1 < end && !/\s/.test(text[at + 1])) {
        const close = text.indexOf("*", at + 1);
        if (close !== -1 && close < end && !/\s/.test(text[close - 1])) {
          flush(at);
          const em = document.createElement("em");
          this.inline(em, at + 1, close);
          parent.appendChild(em);
          handled = close + 1;
        }
      } else if (ch === "[") {
        handled = this.link(parent, at, end, flush);
      }
      if (handled) {
        at = handled;
        plainFrom = at;
      } else {
        at++;
      }
    }
    flush(end);
  }

  link(parent, at, end, flush) {
    const text = this.text;
    const labelEnd = text.indexOf("](", at + 1);
    if (labelEnd === -1 || labelEnd >= end) return 0;
    const urlEnd = text.indexOf(")", labelEnd + 2);
    if (urlEnd === -1 || urlEnd >= end) return 0;
    const url = text.slice(labelEnd + 2, urlEnd);
    if (!SAFE_LINK.test(url) || labelEnd === at + 1) return 0;  // no javascript:, data:, relative
    flush(at);
    const a = document.createElement("a");
    a.href = url;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    this.appendText(a, at + 1, labelEnd);
    parent.appendChild(a);
    return urlEnd + 1;
  }
}

// Renders text as a DocumentFragment; draftedRanges: sorted, disjoint [start, end) offsets.
export function renderMarkdown(text, draftedRanges, onCopy) {
  return new Renderer(text, draftedRanges, onCopy).render();
}

// Plain text (reasoning) with the same tinting, line breaks kept by CSS (white-space: pre-wrap).
export function renderPlain(text, draftedRanges) {
  const root = document.createDocumentFragment();
  new Renderer(text, draftedRanges, null).appendText(root, 0, text.length);
  return root;
}
