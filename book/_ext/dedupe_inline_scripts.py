"""Drop repeated inline <script> bodies from each page.

sphinx-thebe 0.3 adds its inline configuration script from an event that runs after the HTML
builder has started, and Sphinx 7 then registers it twice (once in the registry, once in the
builder). The page declares `const THEBE_JS_URL` twice and the browser logs a SyntaxError.
Sphinx already skips repeated script files; this does the same for inline bodies.
"""


def _dedupe(app, pagename, templatename, context, doctree):
    seen, kept = set(), []
    for script in context.get("script_files", []):
        body = getattr(script, "attributes", {}).get("body")
        if body and body in seen:
            continue
        if body:
            seen.add(body)
        kept.append(script)
    context["script_files"] = kept


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
