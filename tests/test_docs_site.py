"""The documentation site as a reader gets it: built strictly, served over HTTP, rendered by a headless Chromium.

The build is mkdocs with ``--strict`` (a broken link, a docstring the reference cannot parse, a page missing from the
navigation all fail it). The home page and an API page are then loaded in Debian's ``chromium``: the screenshot must
not be blank and the rendered document must hold the page's own text, so a page that breaks in a browser (a theme
asset missing, a script error that empties the body) fails here and not in a user's hands.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The systems' own names, as users of DeepSpeed and Megatron search for them, and the project's main types: each must
# have its entry in the API reference.
REFERENCE_NAMES = (
    "DeepSpeedZeroOptimizer_Stage3",
    "DeepSpeedIOEngine",
    "PipelineModule",
    "init_compression",
    "backend_fn",
    "module_inject",
    "DeepSpeedDataSampler",
    "HybridCPDataLoaderWrapper",
    "zero3_shard",
    "ZeroConfig",
    "NVMeOffload",
    "ZStackZero3Strategy",
    "PipelineStrategy",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None  # type: ignore[method-assign,assignment]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("Debian's chromium is needed for the docs check: `make browser` (apt-get install chromium)")
    return found


def _browser(url: str, tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp / 'profile'}",
            "--window-size=1280,900",
            *flags,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _screenshot_is_a_page(png: Path) -> tuple[bool, str]:
    from PIL import Image, ImageStat

    image = Image.open(png).convert("L")
    stat = ImageStat.Stat(image)
    histogram = image.histogram()
    background = max(histogram) / sum(histogram)  # share of the most common grey level
    dark = sum(histogram[:128]) / sum(histogram)  # text, code, the header bar
    ok = stat.stddev[0] > 20 and background < 0.97 and dark > 0.01
    return ok, f"stddev {stat.stddev[0]:.1f}, most common level {background:.1%}, dark {dark:.1%}"


@pytest.mark.parametrize(
    "path,expected",
    [("", "Lightning"), ("api/zero/", "DeepSpeedZeroOptimizer_Stage3")],
    ids=["home", "api-zero"],
)
def test_page_renders_in_a_browser(served: str, path: str, expected: str, tmp_path: Path) -> None:
    url = f"{served}/{path}"
    dom = _browser(url, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert expected in dom.stdout, f"{url}: the rendered document lacks {expected!r}"
    assert 'class="md-nav' in dom.stdout, f"{url}: the theme's navigation did not render"
    png = tmp_path / "page.png"
    shot = _browser(url, tmp_path, f"--screenshot={png}")
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    ok, why = _screenshot_is_a_page(png)
    assert ok, f"{url}: the screenshot looks blank ({why}); see {png}"


def test_reference_has_an_entry_for_every_system_name(site: Path) -> None:
    pages = "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))
    missing = [name for name in REFERENCE_NAMES if not re.search(rf'id="zlightning\.[\w.]*\b{name}"', pages)]
    assert not missing, f"no API reference entry for {missing}"


def test_every_documented_package_exports_only_documented_names(site: Path) -> None:
    import importlib

    pages = "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))
    undocumented = []
    for module_name in sorted(set(_reference_modules())):
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            if f'id="{module_name}.{name}"' not in pages:
                undocumented.append(f"{module_name}.{name}")
    assert not undocumented, f"in __all__ but without an API reference entry: {undocumented}"


def _reference_modules() -> Iterator[str]:
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for line in page.read_text().splitlines():
            if line.startswith("::: "):
                yield line[4:].strip()
