"""Loads the compiled extension ``specattn._C`` if it was built; records why not otherwise."""
import json
import os

import torch  # noqa: F401  loads libc10/libtorch before the extension

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load():
    try:
        from specattn import _C  # noqa: F401  registers torch.ops.specattn.*
        return True, None
    except ImportError as e:
        reason = None
        info = os.path.join(_HERE, "_build_info.json")
        if os.path.exists(info):
            with open(info) as f:
                reason = json.load(f).get("reason")
        return False, reason or f"specattn._C not importable ({e})"


EXT_AVAILABLE, EXT_MISSING_REASON = _load()
