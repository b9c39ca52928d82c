"""The page at ``GET /api/v1/docs``: the OpenAPI document (``openapi.json``, beside it) as a
page to read. Self-contained, its style and script inline, so it works where the server's
machine has no internet: every operation by tag (method, path, how it authenticates, its
parameters, body and answers), then every schema, each type a link to its schema.

(Swagger UI would do more, but the wheel that ships it alone, swagger-ui-bundle, carries a
version that cannot render OpenAPI 3.1, and the one that ships a newer one needs flask-openapi3.)
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>zwdx API</title>
<style>
body{font:14px/1.5 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{margin:0 0 4px}h2{margin:32px 0 8px;border-bottom:1px solid #d5d9e0;padding-bottom:4px}
details{background:#fff;border:1px solid #d5d9e0;border-radius:6px;margin:6px 0}
summary{cursor:pointer;padding:8px 12px;display:flex;gap:12px;align-items:baseline}
.body{padding:4px 16px 12px}
.m{font:600 12px monospace;padding:2px 6px;border-radius:4px;color:#fff;min-width:44px;text-align:center}
.get{background:#2b6cb0}.post{background:#2f855a}.put{background:#b7791f}.delete{background:#c53030}
code,.path{font-family:ui-monospace,monospace}.path{font-weight:600}
.sum{color:#4a5568}.auth{font-size:12px;color:#6b4f00;background:#fff5d6;padding:1px 6px;border-radius:4px}
table{border-collapse:collapse;width:100%;margin:6px 0}
th,td{text-align:left;border-bottom:1px solid #edf0f4;padding:4px 8px;vertical-align:top}
th{font-weight:600;color:#4a5568;font-size:12px}.req{color:#c53030}.note{color:#718096;font-size:12px}
a{color:#2b6cb0}.err{color:#c53030}
</style></head>
<body><main><h1 id="title">zwdx API</h1><p id="intro" class="sum">Loading openapi.json ...</p>
<div id="ops"></div><h2>Schemas</h2><div id="schemas"></div></main>
<script>
"use strict";
const el = (tag, attrs = {}, ...kids) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const kid of kids) node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  return node;
};
const refName = (ref) => ref.split("/").pop();
const prose = (text) => {  // `code` in a description as <code>
  const span = el("span");
  String(text || "").split("`").forEach((part, i) => span.append(i % 2 ? el("code", {}, part) : part));
  return span;
};
function type(s) {
  if (!s) return "any";
  if (s.$ref) return el("a", {href: "#schema-" + refName(s.$ref)}, refName(s.$ref));
  if (s.anyOf) return join(s.anyOf.map(type), " | ");
  if (s.enum) return s.enum.map((v) => JSON.stringify(v)).join(" | ");
  if (s.const !== undefined) return JSON.stringify(s.const);
  if (s.type === "array") return join([type(s.items), "[]"], "");
  if (s.type === "object" && s.additionalProperties && typeof s.additionalProperties === "object")
    return join(["{string: ", type(s.additionalProperties), "}"], "");
  if (s.contentMediaType) return s.contentMediaType;
  return s.type || "any";
}
function join(parts, sep) {
  const span = el("span");
  parts.forEach((p, i) => { if (i) span.append(sep); span.append(p instanceof Node ? p : String(p)); });
  return span;
}
function limits(s) {
  const out = [];
  for (const k of ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
                   "minItems", "maxItems", "pattern", "default"])
    if (s && s[k] !== undefined) out.push(k + " " + JSON.stringify(s[k]));
  for (const sub of (s && s.anyOf) || []) out.push(...limits(sub));
  return out.join(", ");
}
function props(schema) {
  const table = el("table", {}, el("tr", {}, el("th", {}, "field"), el("th", {}, "type"), el("th", {}, "notes")));
  const required = new Set(schema.required || []);
  for (const [name, p] of Object.entries(schema.properties || {})) {
    table.append(el("tr", {}, el("td", {}, el("code", {}, name), required.has(name) ? el("span", {class: "req"}, " *") : ""),
      el("td", {}, type(p)), el("td", {}, el("div", {}, prose(p.description)), el("div", {class: "note"}, limits(p)))));
  }
  return table;
}
function operation(path, method, op) {
  const auth = (op.security || []).map((s) => Object.keys(s).join(" + ")).join(" or ") || "none";
  const body = el("div", {class: "body"});
  if (op.description) body.append(el("p", {}, prose(op.description)));
  body.append(el("p", {}, "Authentication: ", el("span", {class: "auth"}, auth)));
  if (op.parameters && op.parameters.length) {
    const t = el("table", {}, el("tr", {}, el("th", {}, "parameter"), el("th", {}, "in"), el("th", {}, "type"), el("th", {}, "notes")));
    for (const p of op.parameters)
      t.append(el("tr", {}, el("td", {}, el("code", {}, p.name), p.required ? el("span", {class: "req"}, " *") : ""),
        el("td", {}, p.in), el("td", {}, type(p.schema)), el("td", {}, el("div", {}, prose(p.description)), el("div", {class: "note"}, limits(p.schema)))));
    body.append(t);
  }
  if (op.requestBody) {
    const [media, c] = Object.entries(op.requestBody.content)[0];
    body.append(el("p", {}, "Body (" + media + (op.requestBody.required ? "" : ", optional") + "): ", type(c.schema)));
  }
  const answers = el("table", {}, el("tr", {}, el("th", {}, "status"), el("th", {}, "answer"), el("th", {}, "meaning")));
  for (const [status, r] of Object.entries(op.responses)) {
    const c = Object.entries(r.content || {})[0];
    answers.append(el("tr", {}, el("td", {class: status >= 400 ? "err" : ""}, status),
      el("td", {}, c ? type(c[1].schema) : ""), el("td", {}, prose(r.description))));
  }
  body.append(answers);
  return el("details", {id: op.operationId},
    el("summary", {}, el("span", {class: "m " + method}, method.toUpperCase()), el("span", {class: "path"}, path),
       el("span", {class: "sum"}, op.summary || "")), body);
}
fetch("openapi.json").then((r) => r.json()).then((doc) => {
  document.getElementById("title").textContent = doc.info.title + " API " + doc.info.version;
  document.getElementById("intro").replaceChildren(prose(doc.info.description));
  const byTag = {};
  for (const [path, item] of Object.entries(doc.paths))
    for (const [method, op] of Object.entries(item)) (byTag[(op.tags || ["other"])[0]] ||= []).push([path, method, op]);
  const ops = document.getElementById("ops");
  for (const [tag, list] of Object.entries(byTag)) {
    ops.append(el("h2", {}, tag));
    for (const [path, method, op] of list) ops.append(operation(path, method, op));
  }
  const schemas = document.getElementById("schemas");
  for (const [name, s] of Object.entries(doc.components.schemas)) {
    const body = el("div", {class: "body"});
    if (s.description) body.append(el("p", {}, prose(s.description)));
    body.append(s.properties ? props(s) : el("p", {}, type(s)));
    schemas.append(el("details", {id: "schema-" + name}, el("summary", {}, el("code", {}, name)), body));
  }
  if (location.hash) { const t = document.getElementById(location.hash.slice(1)); if (t) { t.open = true; t.scrollIntoView(); } }
  document.addEventListener("click", (e) => {
    const a = e.target.closest("a[href^='#']"); if (!a) return;
    const t = document.getElementById(a.getAttribute("href").slice(1)); if (t) t.open = true;
  });
}).catch((err) => { document.getElementById("intro").textContent = "Could not load openapi.json: " + err; });
</script></body></html>
"""


def _inline_hashes(tag: str) -> str:
    """The CSP sources that allow the page's inline ``<tag>`` blocks, by their sha256."""
    import base64
    import hashlib
    import re
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", PAGE, flags=re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)


#: The page's Content-Security-Policy: its own inline style and script, and openapi.json beside it.
CSP = (f"default-src 'none'; script-src {_inline_hashes('script')}; style-src {_inline_hashes('style')}; "
       f"connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
