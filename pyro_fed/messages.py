"""Warnings reported at the user's line.

A warning of pyro_fed is raised deep inside a call the user made (``mcmc.run(...)``: Pyro's sampler, the
kernel, the warm-up), at a depth that depends on the path; a fixed ``stacklevel`` names a line of pyro_fed
or of Pyro, where a user can do nothing. :func:`warn` names the innermost frame outside pyro_fed, the
libraries it runs under (Pyro, PyTorch, NumPy, ArviZ, xarray) and the standard library: the user's line.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings

#: the packages whose frames stand between a warning and the user's line, when they are loaded
LIBRARIES = ("pyro", "torch", "numpy", "arviz", "xarray")


def _internal_prefixes() -> tuple[str, ...]:
    """The folders of pyro_fed, of the loaded ``LIBRARIES`` and of the standard library."""
    folders = [os.path.dirname(os.path.abspath(__file__))]
    for name in LIBRARIES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            folders.append(os.path.dirname(os.path.abspath(path)))
    folders.append(os.path.abspath(sysconfig.get_paths()["stdlib"]))
    return tuple(folder + os.sep for folder in folders)


def _internal(filename: str, prefixes: tuple[str, ...]) -> bool:
    path = os.path.abspath(filename)
    # a package installed under the standard library's folder (a Python without a virtual environment) is
    # the user's, unless it is one of the libraries
    standard = prefixes[-1]
    if path.startswith(standard) and "site-packages" in path[len(standard) :]:
        return path.startswith(prefixes[:-1])
    return path.startswith(prefixes) or filename.startswith("<frozen")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """:func:`warnings.warn` of ``message`` at the innermost frame outside pyro_fed and the libraries it runs
    under (the caller's caller where every frame is theirs)."""
    prefixes = _internal_prefixes()
    frame, level = sys._getframe(1), 2
    while frame is not None and _internal(frame.f_code.co_filename, prefixes):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
