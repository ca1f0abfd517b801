"""Fetch llama.cpp's prebuilt CPU library (node-llama-cpp's package on the npm registry) into a folder, for
qlora-export's k-quants: the tarball is downloaded over HTTPS, checked against the registry's pinned sha512, and only
its library folder is kept. Python alone does it: no Node.js or npm is needed.

    python scripts/fetch_llama_cpp.py OUT_DIR [linux-x64|linux-arm64]
"""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "3.22.1"
# the registry's own `dist.integrity` of each package at VERSION (npm view @node-llama-cpp/<platform>@VERSION)
INTEGRITY = {
    "linux-x64": "5uCCDNqWCNfaAm8aR/Uzxbo4HBpKgNF91kCHPepKhgMgV2OAmatoefbOlMihsqCiH2Od35E/eUHQCFbfRBJuOg==",
    "linux-arm64": "W+7naKCXX9/eEjjFmRS8vvx91QyLXDbeFxexZc3bh/PtQABZgmRL3C0AtYYXn4YGTj/3Qor4lWZn2tpjZFPLdQ==",
}


def fetch(out: Path, platform: str) -> None:
    url = f"https://registry.npmjs.org/@node-llama-cpp/{platform}/-/{platform}-{VERSION}.tgz"
    with urllib.request.urlopen(url, timeout=120) as response:
        payload = response.read()
    digest = base64.b64encode(hashlib.sha512(payload).digest()).decode()
    if digest != INTEGRITY[platform]:
        raise SystemExit(f"error: {url} does not match its pinned sha512: not extracted")
    prefix = f"package/bins/{platform}/"
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:gz") as archive:
        for member in archive.getmembers():
            if member.name.startswith(prefix) and member.isfile():
                member.name = member.name[len(prefix):]
                archive.extract(member, out, filter="data")


if __name__ == "__main__":
    fetch(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "linux-x64")
