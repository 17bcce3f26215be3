"""A real headless Chromium, for tests that look at a page as a person would.

:func:`screenshot` renders a local HTML file into a PNG with Chromium's own
``--screenshot`` mode, in a fresh profile directory, offline (no network
features, no GPU), giving scripts ``virtual_time_s`` of virtual time to draw
before the picture is taken, and killing the browser after ``timeout_s``.
:func:`dom` gives the page's DOM once its scripts ran. :func:`ink`
measures a PNG: how much of it is not background.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import attrs

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install -y chromium"


def screenshot(browser: str, page: Path, png: Path, *, width: int = 1400,
               height: int = 1200, virtual_time_s: float = 10.0,
               timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return _chromium(browser, page, [f"--window-size={width},{height}",
                                     f"--screenshot={png}"], virtual_time_s, timeout_s)


def dom(browser: str, page: Path, *, virtual_time_s: float = 10.0,
        timeout_s: float = 120.0) -> str:
    """The page's DOM once its scripts ran (``--dump-dom``)."""
    done = _chromium(browser, page, ["--dump-dom"], virtual_time_s, timeout_s)
    done.check_returncode()
    return done.stdout


def _chromium(browser: str, page: Path, flags: list[str], virtual_time_s: float,
              timeout_s: float) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
             f"--virtual-time-budget={int(virtual_time_s * 1000)}", *flags,
             page.resolve().as_uri()],
            capture_output=True, text=True, timeout=timeout_s, check=False)


@attrs.frozen(kw_only=True)
class Ink:
    width: int
    height: int
    inked: int  # pixels that differ from white by more than a faint anti-aliasing edge
    colours: int  # distinct colours among them (coarse: 4 bits a channel)
    near: dict[str, int]  # pixels within a small distance of each colour asked for

    @property
    def fraction(self) -> float:
        return self.inked / (self.width * self.height)


def ink(png: Path, colours: tuple[str, ...] = ()) -> Ink:
    """``colours``: ``#rrggbb`` strings to count (each channel within 24)."""
    from PIL import Image

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        data = rgb.tobytes()
    tally = Counter(p for p in zip(data[0::3], data[1::3], data[2::3], strict=True)
                    if 765 - sum(p) > 48)
    near = {}
    for colour in colours:
        want = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        near[colour] = sum(n for pixel, n in tally.items()
                           if max(abs(a - b) for a, b in zip(pixel, want, strict=True)) <= 24)
    return Ink(width=rgb.width, height=rgb.height, inked=sum(tally.values()),
               colours=len({(r >> 4, g >> 4, b >> 4) for r, g, b in tally}), near=near)
