"""The pool's host copy of the checkpoint tensors its engine serves, which each version is applied to.

An engine that keeps its weights where the pool cannot write them in place (vLLM's processed
parameters, an SGLang server's GPUs) is handed only the tensors a version changes. The host copy
(bf16 on the CPU, named as in the model directory) is where a decoded delta is applied, with the
tensors it overwrites saved first, so that the pool learns which tensors change and what they become,
and can put the previous version back, in the copy and in the engine, when the engine fails to take
the update.

A full snapshot's tensors are adopted as they are (no copy), but they belong to its `DecodedVersion`,
which the pool also writes to its synced directory, possibly later (a plan of a full snapshot and a
delta after it is swapped in whole before the directory write reads the snapshot). So the copy never
writes into an adopted tensor: the first delta that changes one patches a private copy of it.
"""

from __future__ import annotations

import torch

from deltamesh.delta import BaseMismatchError, CorruptError, DecodedVersion, SmallWordIndex, apply_version


class HostWeights:
    """The host copy (see the module docstring). `apply` returns a version's tensors and the names of
    those it changes; `commit` makes them the copy once the engine has them; `undo` puts back what a
    failed delta wrote."""

    def __init__(self, weights: dict[str, torch.Tensor], weights_hash: str | None) -> None:
        self.weights = weights
        self.weights_hash = weights_hash
        self._spare: dict[str, torch.Tensor] = {}  # tensors a delta changed, as they were before it
        self._before: dict[str, torch.Tensor] = {}  # the previous tensors of the last `apply`
        self._small_index = SmallWordIndex()  # moved along by each delta applied here: see deltamesh.delta
        self._borrowed: set[str] = set()  # tensors adopted from a full snapshot, not to be written into

    def apply(self, version: DecodedVersion, served: int, *, diff: bool = True) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The weights of `version` (a delta onto version `served`, or a full snapshot) and the names
        of the tensors whose bytes it changes (a full snapshot without `diff`: all of them); the
        previous tensors stay available to `previous`."""
        manifest = version.manifest
        if manifest.kind == "delta":
            if manifest.base_version != served:
                raise BaseMismatchError(f"{manifest.model_id} v{manifest.version} is a delta from "
                                        f"v{manifest.base_version}, the engine serves v{served}")
            if version.whole:
                raise CorruptError(f"{manifest.model_id} v{manifest.version} adds tensors the model lacks")
            changed = [manifest.tensors[i].name for i in version.updates]
            for name in changed:
                if name not in self.weights:
                    raise CorruptError(f"{manifest.model_id} v{manifest.version}: model has no tensor {name!r}")
            for name in self._borrowed.intersection(changed):
                self.weights[name] = self.weights[name].clone()
                self._borrowed.discard(name)
            for name in changed:
                spare = self._spare.get(name)
                if spare is None or spare.shape != self.weights[name].shape or spare.dtype != self.weights[name].dtype:
                    spare = self._spare[name] = torch.empty_like(self.weights[name])
                spare.copy_(self.weights[name])
            # In place: on a wrong base or result the applier restores every word it wrote.
            result = apply_version(version, self.weights, base_hash=self.weights_hash, in_place=True,
                                   small_index=self._small_index)
            self._before = {name: self._spare[name] for name in changed}
        else:
            result = apply_version(version)
            if set(result) != set(self.weights):
                raise CorruptError(f"{manifest.model_id} v{manifest.version}: tensors differ from the model's")
            changed = [n for n, t in result.items() if not diff or not _same_bytes(t, self.weights[n])]
            self._before = {name: self.weights[name] for name in changed}
        return result, changed

    def previous(self) -> dict[str, torch.Tensor]:
        """The tensors the last `apply` changed, as they were before it."""
        return self._before

    def commit(self, result: dict[str, torch.Tensor], weights_hash: str | None, *, adopted: bool = False) -> None:
        """Make `result` the copy; `adopted`: its tensors are a full snapshot's own (never written into)."""
        self.weights, self.weights_hash = result, weights_hash
        self._borrowed = set(result) if adopted else set()

    def undo(self, version: DecodedVersion) -> None:
        """Put back the tensors a delta wrote into the host copy (a full snapshot never wrote there)."""
        if version.manifest.kind == "delta":
            for name, before in self._before.items():
                self.weights[name].copy_(before)
            self._small_index.clear()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
