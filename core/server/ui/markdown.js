// A small Markdown renderer for model output that builds DOM nodes and never parses HTML.
//
// Every piece of text reaches the page through document.createTextNode, so markup in a model's answer
// (<img onerror=...>, <script>) shows as the characters it is. Links keep only http(s) and mailto
// targets. It covers what chat answers use: fenced code, headings, lists, quotes, rules, paragraphs,
// inline code, bold, italic and links. A fence still open while an answer streams renders as code.
"use strict";

(function () {
  const SAFE_SCHEMES = new Set(["http:", "https:", "mailto:"]);
  // The earliest of: `code`, **bold**, *italic*, _italic_, [text](url).
  const INLINE = /`([^`\n]+)`|\*\*([^*\n]+?)\*\*|\*([^*\s][^*\n]*?)\*|\b_([^_\s][^_\n]*?)_\b|\[([^\]\n]+)\]\(([^)\s]+)\)/;

  function element(tag, children) {
    const node = document.createElement(tag);
    for (const child of children || []) node.append(child);
    return node;
  }

  function safeHref(target) {
    try {
      const url = new URL(target, document.baseURI);
      return SAFE_SCHEMES.has(url.protocol) ? url.href : null;
    } catch {
      return null;
    }
  }

  function inline(text) {
    const nodes = [];
    let rest = text;
    while (rest) {
      const match = INLINE.exec(rest);
      if (!match) {
        nodes.push(document.createTextNode(rest));
        break;
      }
      if (match.index > 0) nodes.push(document.createTextNode(rest.slice(0, match.index)));
      const [whole, code, bold, star, under, label, target] = match;
      if (code !== undefined) nodes.push(element("code", [document.createTextNode(code)]));
      else if (bold !== undefined) nodes.push(element("strong", inline(bold)));
      else if (star !== undefined || under !== undefined) nodes.push(element("em", inline(star ?? under)));
      else {
        const href = safeHref(target);
        if (href === null) nodes.push(document.createTextNode(whole));
        else {
          const link = element("a", inline(label));
          link.href = href;
          link.rel = "noopener noreferrer";
          link.target = "_blank";
          nodes.push(link);
        }
      }
      rest = rest.slice(match.index + whole.length);
    }
    return nodes;
  }

  function withBreaks(lines) {
    const nodes = [];
    lines.forEach((line, i) => {
      if (i > 0) nodes.push(document.createElement("br"));
      nodes.push(...inline(line));
    });
    return nodes;
  }

  const FENCE = /^\s*(```|~~~)\s*([\w+.#-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;

  function codeBlock(lines, language) {
    const code = element("code", [document.createTextNode(lines.join("\n"))]);
    if (language) code.dataset.language = language;
    return element("pre", [code]);
  }

  function list(lines, start, pattern, tag) {
    const items = [];
    let i = start;
    for (; i < lines.length; i++) {
      const match = pattern.exec(lines[i]);
      if (match) items.push(element("li", inline(match[1])));
      else if (lines[i].trim() && items.length && /^\s+/.test(lines[i])) items[items.length - 1].append(" ", ...inline(lines[i].trim()));
      else break;
    }
    return [element(tag, items), i];
  }

  function blocks(text) {
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = FENCE.exec(line);
      if (fence) {
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
        out.push(codeBlock(body, fence[2]));
        i++;
        continue;
      }
      if (!line.trim()) { i++; continue; }
      const heading = HEADING.exec(line);
      if (heading) { out.push(element("h" + heading[1].length, inline(heading[2]))); i++; continue; }
      if (RULE.test(line)) { out.push(document.createElement("hr")); i++; continue; }
      if (BULLET.test(line) || NUMBERED.test(line)) {
        const numbered = !BULLET.test(line);
        const [node, next] = list(lines, i, numbered ? NUMBERED : BULLET, numbered ? "ol" : "ul");
        out.push(node);
        i = next;
        continue;
      }
      if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(QUOTE.exec(lines[i])[1]);
        out.push(element("blockquote", blocks(quoted.join("\n"))));
        continue;
      }
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !BULLET.test(lines[i])
             && !NUMBERED.test(lines[i]) && !QUOTE.test(lines[i]); i++) paragraph.push(lines[i]);
      if (!paragraph.length) { paragraph.push(line); i++; }
      out.push(element("p", withBreaks(paragraph)));
    }
    return out;
  }

  /** The Markdown `text` as a DocumentFragment of elements and text nodes (no HTML is parsed). */
  function renderMarkdown(text) {
    const fragment = document.createDocumentFragment();
    fragment.append(...blocks(String(text)));
    return fragment;
  }

  window.renderMarkdown = renderMarkdown;
})();
