"""What a weight file says about itself: the network it is the weights of, the input it takes
and how that input was normalised, so that ``hetconv export`` and ``hetconv evaluate`` need
nothing but the file, and so does anyone who runs the exported graph.

A :class:`Description` is a JSON object. A model ``.npz`` carries it as the zip archive's
comment, so ``np.load`` still lists only the weights (they load into PyTorch as they are) and
it is read without unpickling anything::

    json.loads(zipfile.ZipFile("model.npz").comment)

A checkpoint carries it in its ``meta`` record (:mod:`hetconv.training.checkpoint`).

Its keys: ``format`` and ``version``; ``network`` (the model as ``--model`` named it);
``spec`` (the layers the network was built from, as a ``.json`` spec file holds them);
``input_shape`` (C, H, W); ``classes`` and ``class_names`` (the data's class folders, or
null); ``normalisation``: ``scale``, ``mean`` and ``std`` (one per channel) and ``raw`` (what
the data held: ``uint8 0..255`` pixels or ``float32`` values). The network's input is
``(raw * scale - mean[c]) / std[c]`` per channel c, as the training batches were.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Description", "read_description", "write_description"]

FORMAT = "hetconv-model"
VERSION = 1
#: A zip comment holds at most this many bytes.
_COMMENT_LIMIT = 65535
UINT8 = "uint8 0..255"
FLOAT32 = "float32"


@dataclass(frozen=True)
class Description:
    """A network's spec, its input and the input's normalisation (see the module)."""

    network: str
    spec: tuple[dict, ...]
    input_shape: tuple[int, int, int]
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float
    raw: str
    class_names: tuple[str, ...] | None = None

    @classmethod
    def of(cls, network: str, spec: Sequence[Mapping], data) -> Description:
        """What a training run on ``data`` (a loaded dataset: ``train``, and ``class_names``
        where the reader knows them) with ``spec`` writes."""
        train = data.train
        names = getattr(data, "class_names", None) or getattr(train, "class_names", None)
        uint8 = train.images.dtype == np.uint8
        return cls(
            network=str(network),
            spec=tuple(json.loads(json.dumps(list(spec), default=_plain))),  # as read back
            input_shape=train.image_shape,
            classes=int(train.num_classes),
            mean=tuple(map(float, train.mean)),
            std=tuple(map(float, train.std)),
            scale=1 / 255 if uint8 else 1.0,
            raw=UINT8 if uint8 else FLOAT32,
            class_names=tuple(map(str, names)) if names else None,
        )

    def as_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "network": self.network,
            "spec": [dict(layer) for layer in self.spec],
            "input_shape": list(self.input_shape),
            "classes": self.classes,
            "class_names": list(self.class_names) if self.class_names else None,
            "normalisation": {
                "scale": self.scale,
                "mean": list(self.mean),
                "std": list(self.std),
                "raw": self.raw,
            },
        }

    @classmethod
    def from_json(cls, document: Mapping) -> Description:
        """Raises ValueError (naming what is wrong) for a document this cannot read."""
        if document.get("format") != FORMAT or document.get("version") != VERSION:
            raise ValueError(
                f"a description of format {document.get('format')!r} version "
                f"{document.get('version')!r}, expected {FORMAT!r} version {VERSION}"
            )
        try:
            norm = document["normalisation"]
            names = document.get("class_names")
            shape = tuple(int(n) for n in document["input_shape"])
            if len(shape) != 3 or not isinstance(document["spec"], list):
                raise ValueError("input_shape is not (C, H, W) or spec is not a list")
            return cls(
                network=str(document["network"]),
                spec=tuple(dict(layer) for layer in document["spec"]),
                input_shape=shape,  # type: ignore[arg-type]
                classes=int(document["classes"]),
                mean=tuple(float(m) for m in norm["mean"]),
                std=tuple(float(s) for s in norm["std"]),
                scale=float(norm["scale"]),
                raw=str(norm["raw"]),
                class_names=tuple(map(str, names)) if names else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a damaged description ({type(e).__name__}: {e})") from None

    def formula(self) -> str:
        """The normalisation in words, for help and metadata."""
        if self.raw == UINT8:
            pixel = "pixel / 255"
        else:
            pixel = "value" if self.scale == 1.0 else f"value * {self.scale:g}"
        return f"({pixel} - mean[c]) / std[c]"

    def normalise(self, raw: np.ndarray) -> np.ndarray:
        """``raw`` (N, C, H, W) as the network takes it, in float32 as training computed it."""
        x = np.asarray(raw).astype(np.float32)
        if self.raw == UINT8:
            x /= np.float32(255.0)
        elif self.scale != 1.0:
            x *= np.float32(self.scale)
        x -= np.asarray(self.mean, np.float32).reshape(1, -1, 1, 1)
        x /= np.asarray(self.std, np.float32).reshape(1, -1, 1, 1)
        return x


def _plain(value: object) -> object:
    """A numpy scalar or array in a spec as the JSON value it stands for."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON")


def _encoded(description: Description) -> bytes:
    document = description.as_json()
    text = json.dumps(document, separators=(",", ":")).encode("utf-8")
    if len(text) > _COMMENT_LIMIT and document["class_names"]:  # very many classes
        document["class_names"] = None
        text = json.dumps(document, separators=(",", ":")).encode("utf-8")
    if len(text) > _COMMENT_LIMIT:
        raise ValueError(f"the description takes {len(text)} bytes, over a zip comment's 65535")
    return text


def write_description(path: str | os.PathLike, description: Description) -> None:
    """Put ``description`` into the ``.npz`` at ``path`` (as its zip comment)."""
    text = _encoded(description)
    with zipfile.ZipFile(path, "a") as archive:
        archive.comment = text


def read_description(path: str | os.PathLike) -> Description | None:
    """The description of the ``.npz`` at ``path``; None when it has none (a file written
    before weight files described themselves, or by ``np.savez`` elsewhere).

    Raises:
        ValueError: the file is not a zip archive, or its description is damaged (naming it).
    """
    try:
        with zipfile.ZipFile(path) as archive:
            comment = archive.comment
    except (OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"cannot read {os.fspath(path)}: {e}") from None
    if not comment:
        return None
    try:
        document = json.loads(comment.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # a comment of some other program's
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return None
    try:
        return Description.from_json(document)
    except ValueError as e:
        raise ValueError(f"{os.fspath(path)} holds {e}") from None
