"""The `distributed:` section: the nodes a capture or train job spans, each key once.

`Nodes` is what the rank launchers read (tasks/runtime/launch_ranks.py); `DistributedConfig`, the section, adds the
machine's memory that the plan and doctor check a capture against.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from settings.base import Section, StrictModel


class Nodes(StrictModel):
    """The nodes a capture or train job spans: one (the defaults), or several sharing RUN_DIR.

    World size = nnodes x the stage's num_gpus (every node runs that many ranks). Global rank r runs on
    node r // num_gpus as its local rank r % num_gpus: node 0 holds ranks 0..num_gpus-1, rank 0 among them.
    """

    nnodes: int = Field(default=1, ge=1, le=1024)
    """Nodes a capture or train job runs on; each runs the stage's num_gpus ranks. Above 1, RUN_DIR (and
    capture.out_dir, train.out_dir) must be one shared filesystem, the repository and its .venv at the same path on
    every node. The pipeline runs on node 0."""
    master_addr: str | None = None
    """Address of node 0 that every node reaches (torchrun: the rendezvous; deepspeed: optional, the first host of the
    hostfile by default). Needed by torchrun when nnodes > 1."""
    master_port: int = Field(default=29500, ge=1, le=65535)
    """nnodes > 1: TCP port on node 0 for the rendezvous and the process group (one node: a free port is picked)."""
    hostfile: Path | None = None
    """deepspeed launcher, nnodes > 1: DeepSpeed's hostfile (`<host> slots=<GPUs>` a line; the first nnodes hosts are
    used). Node 0 starts every node's ranks over passwordless ssh with pdsh."""
    join_timeout_s: int = Field(default=600, ge=1)
    """torchrun, nnodes > 1: how long node 0 waits for the other nodes to join (and they for node 0)."""

    @field_validator("master_addr")
    @classmethod
    def _plain_address(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c.isspace() for c in value) or value.count(":") == 1):
            raise ValueError(
                f"must be the host name or IP address of node 0 (no spaces; the port goes in master_port), "
                f"got {value!r}"
            )
        return value

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1


class DistributedConfig(Nodes, Section):
    """The nodes the capture and train jobs span (settings/distributed.py `Nodes`); each node runs the stage's num_gpus
    ranks.

    torchrun: the pipeline runs on node 0 and starts its ranks; every other node runs
    `eagle3 node CONFIG --node-rank R` (docs/scale-out.md). deepspeed: node 0 starts them all from the hostfile.
    """

    gpu_memory_gib: float = Field(default=140.0, gt=0)
    """Memory of one GPU of a node, in GiB (default: the reference box's H200, 141 GB). `eagle3 plan` and `eagle3
    doctor` refuse a capture that needs more per GPU (tasks/capture/memory.py); vLLM's share is this x its
    --gpu-memory-utilization."""
    host_memory_gib: float = Field(default=2048.0, gt=0)
    """RAM of one node, in GiB (default: the reference box's 2 TiB). What the node's capture ranks keep in it (ZeRO-3
    partitions with capture.offload: cpu, swap buffers with nvme) must fit: the plan and doctor refuse it otherwise."""
