"""Measure a report page in headless Chromium (issue 35): what is wider than the window, and
which table body rows hold no value of ours.

The page is copied into a temporary directory with a small script appended that measures
the laid-out page and writes a JSON verdict into the DOM; Chromium's ``--dump-dom`` prints
the DOM after the script ran, and :func:`measure` parses the verdict back. No Python
dependency: only a ``chromium`` (or ``chromium-browser``, ``google-chrome``) executable.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

#: Chromium's flags for a quiet, offline, one-shot run (without the background-networking
#: ones it keeps trying the network, which is closed here)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio",
         "--hide-scrollbars")

WIDTH = 1280

#: Appended to the page: measures after layout, writes the verdict as JSON into
#: <pre id="width-verdict">. A row "has a value of ours" when one of its <td> that is not an
#: aside (the paper's value, a verdict, a note) shows text other than the missing mark, once
#: the paper's parenthesised values and footnote markers are taken out. ``table_sizes``: each
#: table's laid-out width and scrollWidth, and its cells whose content overflows them or that
#: reach outside the table (issue 64: a cut column).
SCRIPT = r"""
<script>
(function () {
  const vw = window.innerWidth;
  const wide = [];
  for (const el of document.body.querySelectorAll('*')) {
    if (el.id === 'width-verdict') continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (r.right > vw + 0.5 || r.left < -0.5) {
      const t = el.closest('table');
      wide.push({tag: el.tagName.toLowerCase(), id: el.id || null,
                 table: t ? t.id || t.className || 'table' : null,
                 left: Math.round(r.left), right: Math.round(r.right),
                 text: (el.textContent || '').trim().slice(0, 80)});
    }
  }
  const empty = [];
  for (const t of document.querySelectorAll('table')) {
    for (const tr of t.querySelectorAll('tbody tr')) {
      let ours = false;
      for (const td of tr.querySelectorAll('td')) {
        if (td.classList.contains('aside') || td.classList.contains('missing')) continue;
        const c = td.cloneNode(true);
        for (const x of c.querySelectorAll('.paper, sup.fn')) x.remove();
        const text = c.textContent.trim();
        if (text && text !== '\u2014') { ours = true; break; }
      }
      if (!ours) empty.push({table: t.id || t.className || 'table',
                             row: tr.textContent.trim().slice(0, 80)});
    }
  }
  const sizes = [];
  for (const t of document.querySelectorAll('table')) {
    const r = t.getBoundingClientRect();
    const cut = [];
    for (const c of t.querySelectorAll('th, td')) {
      const cr = c.getBoundingClientRect();
      if (c.scrollWidth > c.clientWidth + 1 || cr.right > r.right + 0.5
          || cr.left < r.left - 0.5) cut.push((c.textContent || '').trim().slice(0, 60));
    }
    sizes.push({table: t.id || t.className || 'table', width: Math.round(r.width),
                scrollWidth: t.scrollWidth, cut: cut.slice(0, 10)});
  }
  const pre = document.createElement('pre');
  pre.id = 'width-verdict';
  pre.textContent = JSON.stringify({
    innerWidth: vw, scrollWidth: document.documentElement.scrollWidth,
    tables: document.querySelectorAll('table').length, wide: wide.slice(0, 50),
    n_wide: wide.length, empty_rows: empty, table_sizes: sizes});
  document.body.appendChild(pre);
})();
</script>
"""

MARK = '<pre id="width-verdict">'


def chromium() -> str | None:
    """The Chromium executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(exe: str, args: list[str], profile: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def measure(html: str, width: int = WIDTH, height: int = 1000, timeout: float = 60.0) -> dict:
    """Lay ``html`` out in a ``width`` x ``height`` window; the verdict of :data:`SCRIPT`."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.html"
        body_end = html.rfind("</body>")
        text = (html[:body_end] + SCRIPT + html[body_end:]) if body_end >= 0 else html + SCRIPT
        page.write_text(text, encoding="utf-8")
        out = _run(exe, [f"--window-size={width},{height}", "--virtual-time-budget=5000",
                         "--dump-dom", page.as_uri()], Path(tmp) / "profile", timeout)
    start = out.stdout.find(MARK)
    if start < 0:
        raise RuntimeError(f"chromium wrote no verdict (exit {out.returncode}): "
                           f"{out.stderr[-2000:]}")
    start += len(MARK)
    end = out.stdout.index("</pre>", start)
    import html as _html

    return json.loads(_html.unescape(out.stdout[start:end]))


def screenshot(page: Path, png: Path, width: int = WIDTH, height: int = 900,
               timeout: float = 60.0) -> None:
    """A PNG of the top ``height`` pixels of ``page`` in a ``width``-wide window."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out = _run(exe, [f"--window-size={width},{height}", "--virtual-time-budget=5000",
                         f"--screenshot={png.resolve()}", page.resolve().as_uri()],
                   Path(tmp) / "profile", timeout)
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot (exit {out.returncode}): "
                           f"{out.stderr[-2000:]}")
