"""``python -m prfaas_sglang.docsite {write,check,build}``: the site's generated reference pages, and the site.

    write   render every page of docs/reference/ from the code
    check   exit 1 naming each reference page that is stale (what the tests run)
    build   check, then ``mkdocs build --strict`` into --site-dir (``make docs``): a broken link, a missing
            page or an unknown reference fails it
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from prfaas_sglang.docsite.reference import REPO_ROOT, render_all, stale_pages


def build_site(site_dir: Path, config: Path = REPO_ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``site_dir``; its output captured."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--config-file",
                           str(config), "--site-dir", str(site_dir)],
                          capture_output=True, text=True, cwd=config.parent,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # the theme's banner about its successor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas_sglang.docsite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("write", "check", "build"),
                        help="write: render docs/reference/; check: exit 1 if a page is stale; "
                             "build: check, then mkdocs build --strict")
    parser.add_argument("--site-dir", type=Path, default=REPO_ROOT / "site", help="where build writes the site")
    args = parser.parse_args(argv)
    rendered = render_all()
    if args.command == "write":
        for path, text in rendered.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    if stale := stale_pages(rendered):
        print("stale: " + ", ".join(str(p.relative_to(REPO_ROOT)) for p in stale)
              + "; run `python -m prfaas_sglang.docsite write`", file=sys.stderr)
        return 1
    if args.command == "build":
        built = build_site(args.site_dir)
        sys.stdout.write(built.stdout + built.stderr)
        return built.returncode
    print("every reference page is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
