"""``runtime.backend: ray``: the job's roles as Ray actors on a Ray cluster.

::

    RayRuntime.run(job)
      connect             a local Ray instance, or runtime.ray.address
      placement groups    N PS shards + W trainers (PACK), and one per data
                          executor (given back once it is retired or replaced);
                          all placed or none;
                          a cluster that cannot fit them: an error naming each
                          role, what it asks and what the cluster has
      ServerActor x N     a ParameterServer on TCP (its share of every table)
      TrainerActor x W    run_trainer(rank): torch.distributed over tcp:// (gloo;
                          NCCL for CUDA models), the same trainer as local
      controller          watches every role; a failure goes to the policy:
                          restart every actor from the newest checkpoint
                          (runtime.max_restarts) or fail naming the role

Ray places and watches the processes; trainers reach the servers over the
parameter server's own socket protocol (docs/results.md has the measurements).
Importing this package needs Ray (``pip install 'estuary[ray]'``).
"""

from estuary.runtime.ray.backend import RayRuntime

__all__ = ["RayRuntime"]
