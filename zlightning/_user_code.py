"""Which frames of a traceback or of the stack are the user's own code, as opposed to a library's.

A frame is a library's when its file lies in the Python standard library, in a ``site-packages`` (or ``dist-packages``)
folder, or in the package folders of torch, Lightning or zlightning (``zlightning/`` and the top-level folders mapped
into it, such as ``strategies/``, wherever they are installed from). Everything else is the user's: their scripts,
their project's modules, ``python -c`` and notebook cells. Only the standard library is imported here.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Sequence

__all__ = ["is_library_file", "user_frame", "user_stacklevel"]

_LIBRARY_PACKAGES = (
    "torch",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "lightning_utilities",
    "zlightning",
    "zlightning.strategies",
    "zlightning.datamodules",
    "zlightning.kernels",
)
_PACKAGE_FOLDERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def is_library_file(filename: str) -> bool:
    """Whether code in ``filename`` belongs to the standard library, an installed package, torch, Lightning or
    zlightning (see the module docstring)."""
    if filename.startswith("<"):  # <string>, <stdin>, <ipython-input-...> are the user's; <frozen ...> is Python's
        return filename.startswith("<frozen")
    path = os.path.realpath(filename)
    if any(marker in path for marker in _PACKAGE_FOLDERS):
        return True
    return any(path.startswith(root) for root in _library_roots())


def user_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost of ``frames`` (outermost first, as ``traceback.extract_tb`` lists them) in the user's code."""
    return next((f for f in reversed(frames) if not is_library_file(f.filename)), None)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` issued by this function's caller name the innermost caller
    in the user's code (2, the caller's caller, when the whole stack is library code)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level if frame is not None else 2


def _library_roots() -> tuple[str, ...]:
    """Folders whose files are a library's: fixed per process, except the packages loaded since the last call."""
    loaded = tuple(name for name in _LIBRARY_PACKAGES if name in sys.modules)
    return _roots_for(loaded)


@functools.cache
def _roots_for(loaded: tuple[str, ...]) -> tuple[str, ...]:
    folders: set[str] = set()
    paths = sysconfig.get_paths()
    folders.update(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key))
    try:
        folders.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    for name in loaded:
        folders.update(getattr(sys.modules[name], "__path__", None) or [])
    return tuple(sorted({os.path.join(os.path.realpath(f), "") for f in folders}))
