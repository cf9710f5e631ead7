"""DeepSpeed's own verdict on a config: run ``DeepSpeedConfig``'s parser without a process group.

``DeepSpeedConfig(config)`` asks ``torch.distributed`` for the world size; without an initialised group it falls
back to 1. :func:`refusal` does what its ``__init__`` does -- the removed-key check, ``_initialize_params`` (every
reader and pydantic model), the batch-size arithmetic and the sanity checks -- with the world size given instead,
so a config can be judged for 8 data-parallel ranks on a machine with none. The tests use it to hold ``ds check``
to DeepSpeed: a fail must be something this refuses (or a run that surely breaks), and no fix may make a config
it accepts into one it refuses. With ``DS_ACCELERATOR=cpu`` it runs on any machine.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from .quiet import quiet_deepspeed


def edit(config: dict, edits: list[dict[str, Any]]) -> dict:
    """A copy of ``config`` with a finding's ``data["edits"]`` applied: each ``{"path": [...], "value": V}`` sets a
    value (creating the objects on the way), ``{"path": [...], "remove": true}`` deletes a key."""
    out = copy.deepcopy(config)
    for e in edits:
        *parents, last = e["path"]
        node = out
        for p in parents:
            if not isinstance(node.get(p), dict):
                if e.get("remove"):
                    break
                node[p] = {}
            node = node[p]
        else:
            if e.get("remove"):
                node.pop(last, None)
            else:
                node[last] = copy.deepcopy(e["value"])
    return out


def refusal(config: dict, world_size: int = 1) -> str | None:
    """None when DeepSpeed's parser accepts ``config`` for ``world_size`` data-parallel ranks, else its error as
    ``"Type: message"`` (first line). Raises ImportError when deepspeed is not installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with quiet_deepspeed():
        from deepspeed.runtime import config as ds_config

        cfg = ds_config.DeepSpeedConfig.__new__(ds_config.DeepSpeedConfig)
        cfg.world_size, cfg.global_rank = world_size, 0
        cfg.mesh_device = None
        try:
            cfg._param_dict = config
            ds_config._reject_removed_config_keys(config)
            cfg._initialize_params(copy.copy(config))
            cfg._configure_train_batch_size()
            cfg._do_sanity_check()
        except Exception as e:  # whatever DeepSpeed raises is its refusal
            lines = str(e).strip().splitlines()
            return f"{type(e).__name__}: {lines[0] if lines else ''}"
    return None
