"use strict";
/* A small markdown renderer for model replies: paragraphs, headings, lists, rules, fenced code blocks
   (with their language as a label), **bold**, *italic* and `inline code`.

   Safety first: every piece of the model's text is HTML-escaped before a tag is put around it, and the only
   markup in the result is the fixed tags written below, so a reply holding <script> or <img onerror=...>
   shows as that text. No links or images are rendered at all.

   renderMarkdown(text) -> HTML string. It takes unfinished text too (a reply still streaming): an unclosed
   code fence runs to the end. */

const renderMarkdown = (() => {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;

  /* Inline formatting of one block's text: the text is escaped, code spans are set aside (nothing inside
     them is formatted), the emphasis markers (which escaping leaves alone) become tags, the spans come back. */
  function inline(text) {
    const spans = [];
    return escapeHtml(text.replace(/\0/g, ""))
      .replace(/`([^`\n]+)`/g, (_, span) => `\0${spans.push(span) - 1}\0`)
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^\s*](?:[^*]*[^\s*])?)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/\0(\d+)\0/g, (_, i) => `<code>${spans[i]}</code>`)
      .replace(/\n/g, "<br>");
  }

  function codeBlock(lang, lines) {
    const label = lang ? `<span class="lang">${escapeHtml(lang)}</span>` : "<span></span>";
    return `<div class="code"><div class="code-head">${label}<button type="button" class="copy">copy</button></div>` +
           `<pre><code>${escapeHtml(lines.join("\n"))}</code></pre></div>`;
  }

  function render(text) {
    const out = [];
    let paragraph = [];   // the lines of the paragraph being read
    let list = null;      // the list being read: {tag, start, items: [text]}
    let code = null;      // the fenced block being read: {fence, lang, lines}

    const endParagraph = () => {
      if (paragraph.length) out.push(`<p>${inline(paragraph.join("\n"))}</p>`);
      paragraph = [];
    };
    const endList = () => {
      if (!list) return;
      const start = list.tag === "ol" && list.start !== 1 ? ` start="${list.start}"` : "";
      out.push(`<${list.tag}${start}>${list.items.map((item) => `<li>${inline(item)}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    const endBlocks = () => { endParagraph(); endList(); };
    const addItem = (tag, itemText, start = 1) => {
      endParagraph();
      if (list && list.tag !== tag) endList();
      if (!list) list = { tag, start, items: [] };
      list.items.push(itemText);
    };

    for (const line of text.replace(/\r\n?/g, "\n").split("\n")) {
      if (code) {
        const t = line.trim();
        if (t.length >= code.fence.length && t === code.fence[0].repeat(t.length)) {
          out.push(codeBlock(code.lang, code.lines));
          code = null;
        } else {
          code.lines.push(line);
        }
        continue;
      }
      let m;
      if ((m = line.match(FENCE))) {
        endBlocks();
        code = { fence: m[1], lang: m[2], lines: [] };
      } else if (!line.trim()) {
        endBlocks();
      } else if ((m = line.match(HEADING))) {
        endBlocks();
        out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
      } else if (RULE.test(line)) {
        endBlocks();
        out.push("<hr>");
      } else if ((m = line.match(BULLET))) {
        addItem("ul", m[1]);
      } else if ((m = line.match(NUMBERED))) {
        addItem("ol", m[2], Number(m[1]));
      } else if (list && /^\s/.test(line)) {
        list.items[list.items.length - 1] += "\n" + line.trim();  // an item's continuation line
      } else {
        endList();
        paragraph.push(line);
      }
    }
    if (code) out.push(codeBlock(code.lang, code.lines));  // still streaming: the block so far
    endBlocks();
    return out.join("\n");
  }

  return render;
})();
