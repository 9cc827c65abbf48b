"""The checkpoint folder: names, atomic writes, newest-good lookup, safe loading, weight init.

Names follow VISSL: model_phase{N}.torch, model_iteration{I}.torch,
model_final_checkpoint_phase{N}.torch, and checkpoint.torch, a symlink to the newest one.
Every file is written to a temporary name in the same folder, fsynced and renamed into
place, so a crash at any instant leaves the previous checkpoint loadable. Files are read
with torch.load(weights_only=True): loading never executes code.
"""

import errno
import logging
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ssl_engine.errors import CheckpointError, UserError

log = logging.getLogger(__name__)

POINTER = "checkpoint.torch"
_NAME_RE = re.compile(r"^model_(phase|iteration|final_checkpoint_phase)(\d+)\.torch$")


def phase_checkpoint_name(train_phase_idx: int) -> str:
    return f"model_phase{int(train_phase_idx)}.torch"


def iteration_checkpoint_name(iteration: int) -> str:
    return f"model_iteration{int(iteration)}.torch"


def final_checkpoint_name(train_phase_idx: int) -> str:
    return f"model_final_checkpoint_phase{int(train_phase_idx)}.torch"


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` durable."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _os_error_in(e: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind ``e``: torch.save reports a failed write as a RuntimeError whose
    context holds the real error (ENOSPC, EACCES...)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write ``path`` through a temporary file in the same folder, then rename it into place.

    A failure (disk full, permission) removes the temporary file, leaves any previous
    ``path`` untouched, and raises CheckpointError naming the folder.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        os_error = _os_error_in(e)
        if os_error is not None:
            why = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied", errno.EROFS: "read-only file system"}.get(
                os_error.errno, os_error.strerror or str(os_error)
            )
            raise CheckpointError(f"cannot write {path.name} in {path.parent}: {why}; the previous files there are intact") from e
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(folder: Path) -> List[str]:
    """Delete temporary files that a killed writer left in ``folder`` (their pid is gone)."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = re.match(r"^\..+\.tmp\.(\d+)$", p.name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(p.name)
            except OSError:
                pass
    if removed:
        log.info("removed %d unfinished temporary file(s) of a killed run in %s", len(removed), folder)
    return removed


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def point_to(folder: Path, name: str) -> None:
    """Swap checkpoint.torch to a symlink to ``name`` atomically."""
    folder = Path(folder)
    tmp = folder / f".{POINTER}.tmp.{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(name, tmp)
        os.replace(tmp, folder / POINTER)
        fsync_dir(folder)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise CheckpointError(f"cannot update {POINTER} in {folder}: {e.strerror}") from e


def save_checkpoint(folder: Path, name: str, checkpoint: Dict[str, Any], keep_last: int = -1) -> Path:
    """Write ``checkpoint`` as folder/name atomically, point checkpoint.torch at it, prune old ones."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    atomic_write(path, lambda f: torch.save(checkpoint, f))
    point_to(folder, name)
    if keep_last > 0:
        prune(folder, keep_last, protect={name})
    return path


def list_checkpoints(folder: Path) -> List[Path]:
    """Checkpoint files of a folder, newest first (by modification time, then name)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if _NAME_RE.match(p.name) and p.is_file()]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)


def prune(folder: Path, keep_last: int, protect: Optional[set] = None) -> None:
    """Delete phase/iteration checkpoints beyond the newest ``keep_last``; never a final one."""
    protect = set(protect or ())
    target = os.readlink(Path(folder) / POINTER) if (Path(folder) / POINTER).is_symlink() else None
    if target:
        protect.add(target)
    kept = 0
    for p in list_checkpoints(folder):
        kind = _NAME_RE.match(p.name).group(1)
        if kind == "final_checkpoint_phase":
            continue
        kept += 1
        if kept > keep_last and p.name not in protect:
            try:
                p.unlink()
                log.info("removed old checkpoint %s (CHECKPOINT.KEEP_LAST=%d)", p.name, keep_last)
            except OSError as e:
                log.warning("could not remove old checkpoint %s: %s", p, e.strerror)


def final_checkpoint(folder: Path) -> Optional[Path]:
    """The final checkpoint of a finished training in ``folder``, if there is one."""
    finals = [p for p in list_checkpoints(folder) if p.name.startswith("model_final_checkpoint_phase")]
    return finals[0] if finals else None


def load_checkpoint(path: Path) -> Dict[str, Any]:
    """Read a checkpoint on the CPU without executing code.

    A file carrying pickled objects other than tensors and plain containers is refused;
    a truncated or unreadable file raises CheckpointError naming it.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        blocked = re.search(r"(Unsupported global: GLOBAL [^\s]+|unsupported GLOBAL [^\s]+|GLOBAL [\w.]+ [\w.]+)", text)
        if blocked:
            raise CheckpointError(
                f"refused to load {path}: it carries pickled objects that are not tensors or plain "
                f"containers, and loading it would run code ({blocked.group(1)[:160]})"
            ) from None
        raise CheckpointError(f"{path} is not a checkpoint or is corrupt: it cannot be read as tensors and plain containers") from None
    except (EOFError, zipfile.BadZipFile, RuntimeError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is truncated or unreadable: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a checkpoint: it holds a {type(data).__name__}, not a dict")
    return data


def is_engine_checkpoint(data: Dict[str, Any]) -> bool:
    return isinstance(data.get("classy_state_dict"), dict) and "phase_idx" in data


def newest_good_checkpoint(folder: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint of ``folder`` that loads, with its content.

    checkpoint.torch is tried first; a truncated or unreadable file is skipped with a
    warning naming it, and the next older one is used.
    """
    folder = Path(folder)
    candidates: List[Path] = []
    pointer = folder / POINTER
    if pointer.is_symlink() or pointer.is_file():
        candidates.append(pointer.resolve())
    candidates += [p for p in list_checkpoints(folder) if p.resolve() not in candidates]
    for p in candidates:
        if not p.exists():
            continue
        try:
            data = load_checkpoint(p)
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", p.name, e)
            continue
        if not is_engine_checkpoint(data):
            log.warning("skipping %s: not an ssl_engine checkpoint", p.name)
            continue
        return p, data
    return None


# ----------------------------------------------------------------------------------------
# Weight initialisation of new runs from our checkpoints, VISSL's, or plain state dicts.


def _flatten_vissl_model(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """classy_state_dict -> base_model -> model -> {trunk, heads} becomes 'trunk.x' / 'heads.x'."""
    if "base_model" in state and isinstance(state["base_model"], dict):
        state = state["base_model"]
    if "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if set(state) & {"trunk", "heads"} and all(isinstance(state.get(k, {}), dict) for k in ("trunk", "heads")):
        flat = {}
        for part in ("trunk", "heads"):
            for k, v in state.get(part, {}).items():
                flat[f"{part}.{k}"] = v
        return flat
    return state


def extract_state_dict(data: Dict[str, Any], key_name: str, source: str) -> Dict[str, torch.Tensor]:
    """The model weights held by a loaded file, whatever its layout."""
    state: Any = data
    if key_name and key_name in data:
        state = data[key_name]
    else:
        for k in ("classy_state_dict", "model_state_dict", "state_dict", "model"):
            if k in data and isinstance(data[k], dict):
                state = data[k]
                break
    if isinstance(state, dict):
        state = _flatten_vissl_model(state)
    weights = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if isinstance(state, dict) else {}
    if not weights:
        raise CheckpointError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {source} holds no weights under "
            f"STATE_DICT_KEY_NAME={key_name!r} (top-level keys: {', '.join(map(str, list(data)[:8]))})"
        )
    return weights


def init_model_from_weights(model: torch.nn.Module, weights_cfg: Any) -> Dict[str, List[str]]:
    """Load MODEL.WEIGHTS_INIT.PARAMS_FILE into ``model``; return loaded/missing/unexpected names."""
    path = Path(str(weights_cfg.PARAMS_FILE)).expanduser()
    if not path.is_file():
        raise UserError(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE: {path} does not exist")
    data = load_checkpoint(path)
    weights = extract_state_dict(data, weights_cfg.STATE_DICT_KEY_NAME, str(path))
    remove, append = weights_cfg.REMOVE_PREFIX, weights_cfg.APPEND_PREFIX
    renamed = {}
    for k, v in weights.items():
        if remove and k.startswith(remove):
            k = k[len(remove):]
        renamed[f"{append}{k}"] = v
    skip = [s for s in weights_cfg.SKIP_LAYERS if s]
    own = model.state_dict()
    loaded, unexpected, shape_mismatch = [], [], []
    new_state = {}
    for k, v in renamed.items():
        if any(s in k for s in skip):
            continue
        if k not in own:
            unexpected.append(k)
        elif own[k].shape != v.shape:
            shape_mismatch.append(f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}")
        else:
            new_state[k] = v
            loaded.append(k)
    if not loaded:
        raise UserError(
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE {path}: none of its {len(renamed)} weights match the model "
            f"(first file key {next(iter(renamed), '-')!r}, first model key {next(iter(own), '-')!r}); "
            f"set REMOVE_PREFIX / APPEND_PREFIX / STATE_DICT_KEY_NAME"
        )
    model.load_state_dict(new_state, strict=False)
    missing = [k for k in own if k not in new_state and not any(s in k for s in skip)]
    log.info(
        "initialised weights from %s: %d loaded, %d missing, %d unexpected, %d shape mismatches",
        path, len(loaded), len(missing), len(unexpected), len(shape_mismatch),
    )
    for what, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shape_mismatch)):
        if names:
            log.info("  %s: %s%s", what, ", ".join(names[:10]), " ..." if len(names) > 10 else "")
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected, "shape_mismatch": shape_mismatch}
