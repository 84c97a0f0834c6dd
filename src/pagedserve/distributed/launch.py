"""Entry point for ranks started by torchrun (or anything that sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT): rank 0 runs the pagedserve command line given (serve,
generate, bench offline), every other rank serves it as a tensor-parallel worker.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \\
        -m pagedserve.distributed.launch serve --model /models/m --tensor-parallel-size 4

The same command runs on every host (with its own --node-rank). The workers take their
device type and timeout from the same flags, and the rest (model, dtype, ...) from rank 0.
"""

from __future__ import annotations

import logging
import signal
import sys

import torch

from pagedserve import cli
from pagedserve.config import EngineConfig
from pagedserve.distributed.group import TORCHRUN_ENV, torchrun_env
from pagedserve.distributed.worker import run_worker


def main(argv: list[str] | None = None) -> int:
    env = torchrun_env()
    if env is None:
        print(
            f"pagedserve.distributed.launch: error: {', '.join(TORCHRUN_ENV)} must be set "
            "(start it with torchrun)",
            file=sys.stderr,
        )
        return 2
    rank = int(env["RANK"])
    if rank == 0:
        return cli.main(argv)
    # torchrun forwards SIGINT/SIGTERM to every rank: rank 0 drains, then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s",
    )
    args = cli.build_parser().parse_args(argv)
    config = cli.dataclass_from_args(EngineConfig, args)
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return run_worker(rank, int(env["WORLD_SIZE"]), device, config.tensor_parallel_timeout)


if __name__ == "__main__":
    sys.exit(main())
