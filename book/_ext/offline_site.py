"""Keep the built site self-contained: it works with no network and ships nothing it does not use.

- MathJax comes from the site's own _static (`make mathjax` unpacks it from npm into
  book/_static/mathjax; _config.yml points `mathjax_path` there). A missing file is a build
  warning, so a `--warningiserror` build fails instead of publishing pages whose math never renders.
- myst-nb embeds the notebook's ipywidgets state in every page as a
  `<script type="application/vnd.jupyter.widget-state+json">`. The site loads no widget renderer
  (explorers show their precomputed static face), so nothing reads it: it is dropped.
- An output that is only an ipywidgets view (a tqdm progress bar, a bare widget) has nothing to
  show without a kernel; myst-nb would print its text/plain stand-in ("measuring this cpu: 0%|")
  or leave an empty box. It is dropped, and the output area it leaves empty goes with it.
  (Explorers carry a text/html static face and are kept.)
- A script or stylesheet loaded from another host is a build warning: a page must make no
  request off its own site when it loads (links, such as the launch buttons, are fine).
"""
from pathlib import Path

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import logging

logger = logging.getLogger(__name__)
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STAND_INS = {WIDGET_VIEW, "text/plain"}  # what a widget's output holds when it has no static face


def _external(uri):
    uri = str(getattr(uri, "filename", uri) or "")
    return uri.startswith("//") or "://" in uri


def _check_mathjax(app):
    if app.builder.format != "html":
        return
    path = app.config.mathjax_path
    if _external(path):
        logger.warning(f"mathjax_path is {path!r}, a URL: the site would need the network to "
                       "render math; unpack MathJax with `make mathjax` and set mathjax_path to "
                       "mathjax/tex-svg-full.js")
        return
    roots = [Path(app.confdir, static) for static in app.config.html_static_path]
    if not any((root / path).is_file() for root in roots):
        where = ", ".join(str(root) for root in roots) or "no html_static_path"
        logger.warning(f"MathJax is missing: no {path} under {where}; run `make mathjax` "
                       "(it unpacks MathJax from the npm registry into book/_static/mathjax)")


def _page_scripts(app, pagename, templatename, context, doctree):
    kept = []
    for script in context.get("script_files", []):
        attributes = getattr(script, "attributes", {})
        if attributes.get("type") == WIDGET_STATE:
            continue
        if _external(script):
            logger.warning(f"{pagename}: the page loads the script {script.filename} from "
                           "another host; the site must work offline")
        kept.append(script)
    context["script_files"] = kept
    for sheet in context.get("css_files", []):
        if _external(sheet):
            logger.warning(f"{pagename}: the page loads the stylesheet {sheet.filename} from "
                           "another host; the site must work offline")


class DropWidgetOnlyOutputs(SphinxPostTransform):
    """Drop outputs holding only a widget view and its text stand-in, before myst-nb picks one
    mime type per output (its SelectMimeType runs at priority 4)."""

    default_priority = 3
    formats = ("html",)

    def run(self, **kwargs):
        def is_bundle(node):
            return isinstance(node, nodes.container) and node.get("nb_element") == "mime_bundle"

        for bundle in list(self.document.findall(is_bundle)):
            types = {child.get("mime_type") for child in bundle.children}
            if WIDGET_VIEW not in types or not types <= STAND_INS:
                continue
            parent = bundle.parent
            parent.remove(bundle)
            logger.verbose(f"{self.env.docname}: dropped a widget-only output")
            # an output area, or a cell whose input is hidden, left empty would leave a gap
            while (isinstance(parent, nodes.container) and not parent.children
                   and parent.get("nb_element") in ("cell_code_output", "cell_code")):
                grandparent = parent.parent
                grandparent.remove(parent)
                parent = grandparent


def setup(app):
    app.add_post_transform(DropWidgetOnlyOutputs)
    app.connect("builder-inited", _check_mathjax)
    app.connect("html-page-context", _page_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
