"""Scripts the tensor-parallel tests run in processes of their own (`python -m tests.support.rank_scripts`).

- `driver CHECKPOINT`: load a tp_degree 2 llama from CHECKPOINT (rank processes started), print the
  rank processes' pids on one line, then sleep until killed (the test kills it).
- `torchrun CHECKPOINT FOLDER NODE`: one rank of a tp_degree 4 llama spread over 2 nodes of 2 ranks
  (run under torchrun; NODE is the node rank, so start_rank_id = 2 * NODE): compile into FOLDER
  (rank 0 compiles, the others wait), load, greedy-generate from two prompts and print
  `TOKENS <rank> <json>`.
- `node CHECKPOINT FOLDER`: one node's driver of a tp_degree 4 llama spread over nodes by the
  transformers-neuronx guide's variables (NEURON_RT_ROOT_COMM_ID, NEURON_RANK_ID, NEURON_LOCAL_TP,
  set by the test): compile into FOLDER, load, greedy-generate from two prompts and print
  `RANKS <node> <the ranks it started>` and `TOKENS <node> <json>`.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.support.engine_fixtures import PROMPTS, nxdi_generate

NEW_TOKENS = 8


def _model(checkpoint: str, **neuron: object) -> object:
    from nxdi.shell.config import NeuronConfig
    from nxdi.shell.inference_config import load_pretrained_config
    from nxdi.shell.models import CONFIG_TYPES, MODEL_TYPES

    config = CONFIG_TYPES["llama"](
        NeuronConfig(seq_len=64, torch_dtype="float32", batch_size=2, **neuron),
        load_config=load_pretrained_config(checkpoint),
    )
    return MODEL_TYPES["llama"]["causal-lm"](checkpoint, config)


def driver(checkpoint: str) -> None:
    model = _model(checkpoint, tp_degree=2)
    model.to_cpu()  # type: ignore[attr-defined]
    print(" ".join(str(p.pid) for p in model._runtime.group.procs), flush=True)  # type: ignore[attr-defined]
    time.sleep(600)


def torchrun(checkpoint: str, folder: str, node: int) -> None:
    model = _model(checkpoint, tp_degree=4, start_rank_id=2 * node, local_ranks_size=2)
    model.compile(folder)  # type: ignore[attr-defined]
    model.load(folder)  # type: ignore[attr-defined]
    tokens = nxdi_generate(model, PROMPTS[:2], max_new_tokens=NEW_TOKENS)
    # one write per line: the ranks of a node share its stdout, and print() writes the end separately
    sys.stdout.write(f"TOKENS {os.environ['RANK']} {json.dumps(tokens.tolist())}\n")
    sys.stdout.flush()


def node(checkpoint: str, folder: str) -> None:
    model = _model(checkpoint, tp_degree=4)
    model.compile(folder)  # type: ignore[attr-defined]
    model.load(folder)  # type: ignore[attr-defined]
    tokens = nxdi_generate(model, PROMPTS[:2], max_new_tokens=NEW_TOKENS)
    ranks = list(model._runtime.group.ranks)  # type: ignore[attr-defined]  # the ranks this node started
    sys.stdout.write(f"RANKS {os.environ['NEURON_RANK_ID']} {json.dumps(ranks)}\n")
    sys.stdout.write(f"TOKENS {os.environ['NEURON_RANK_ID']} {json.dumps(tokens.tolist())}\n")
    sys.stdout.flush()
    model.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["driver", checkpoint]:
            driver(checkpoint)
        case ["torchrun", checkpoint, folder, rank]:
            torchrun(checkpoint, folder, int(rank))
        case ["node", checkpoint, folder]:
            node(checkpoint, folder)
        case _:
            sys.exit(__doc__)
