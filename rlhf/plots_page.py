"""The page template of `dvc plots show` / `dvc plots diff` that renders offline (.dvc/config: plots.html_template).

DVC's own page loads vega, vega-lite and vega-embed from a CDN, so offline (this project's default) it stays blank.
This template inlines the three libraries, bundled by vl-convert-python (a pinned dependency), and has no `{scripts}`
placeholder, where DVC would put its CDN tags: the page fetches nothing. Charts render as SVG, so the saved page
holds them as markup. The page is committed (.dvc/plots_page.html, ~0.9 MB) so that `dvc plots` works in a plain
clone; tests/test_plots_page.py checks it is what this module writes with the pinned vl-convert.

Usage: python -m rlhf.plots_page [PATH]   (default .dvc/plots_page.html, where .dvc/config points)
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhf.io import write_text
from rlhf.runtime import PROJECT_ROOT

DEFAULT_PATH = PROJECT_ROOT / ".dvc" / "plots_page.html"
# DVC's chart scripts call vegaEmbed(el, spec): make the libraries globals and SVG the renderer.
GLOBALS = """window.vega = vega; window.vegaLite = vegaLite;
window.vegaEmbed = (el, spec, opts) => vegaEmbed(el, spec, Object.assign({renderer: "svg"}, opts));"""
PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <script type="text/javascript">
BUNDLE
    </script>
    <style>table { border-spacing: 15px; }</style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def page_template() -> str:
    """The page, with `{plot_divs}` (and `{refresh_tag}`) for DVC to fill."""
    import vl_convert

    bundle = vl_convert.javascript_bundle(GLOBALS)
    if "</script" in bundle.lower() or "{plot_divs}" in bundle:  # either would break the page DVC assembles
        raise RuntimeError("the vl-convert bundle cannot be inlined in the DVC page template")
    return PAGE.replace("BUNDLE", bundle)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEFAULT_PATH
    write_text(path, page_template())
    print(f"offline page template for dvc plots -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
