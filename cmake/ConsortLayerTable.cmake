# The layers of the library and what each may use (docs/architecture.md). Read by
# cmake/ConsortLayers.cmake (the targets) and by cmake/ConsortLayerCheck.cmake (the include
# check, in script mode), so the targets and the check cannot disagree.
#
# Lowest first. A layer may use exactly the layers in its _USES list (written out in full, not
# transitively), and its own.
set(CONSORT_LAYERS core device cluster transport actors testing)

# core: errors and their CAF glue, reduce ops, futures, per_replica; nothing of tensors.
set(CONSORT_LAYER_core_USES "")
# device: tensors and nests on CPU and GPU, the host and CUDA kernels, NCCL communicators, and
# checkpoint files of tensors.
set(CONSORT_LAYER_device_USES core)
# cluster: the cluster spec and its resolvers (TF_CONFIG, Slurm, Open MPI); the device layer for
# the GPUs a resolver reports (num_accelerators).
set(CONSORT_LAYER_cluster_USES core device)
# transport: pairs and contexts (local, TCP), membership, the collective algorithms.
set(CONSORT_LAYER_transport_USES core device cluster)
# actors: the engine (replica, collective, strategy actors) and the public API over it.
set(CONSORT_LAYER_actors_USES core device cluster transport)
# testing: consort::testing, workers of a multi-worker job in one process over a simulated network
# (the actors build the workers, the transport's contract is what it simulates).
set(CONSORT_LAYER_testing_USES core device cluster transport actors)

# Private headers, #include "DIR/...": the source directory of each layer. The generated Cap'n
# Proto headers (<schemas/...>) belong to the transport, their only user.
set(CONSORT_LAYER_core_DIRS core)
set(CONSORT_LAYER_device_DIRS device)
set(CONSORT_LAYER_cluster_DIRS cluster)
set(CONSORT_LAYER_transport_DIRS transport schemas)
set(CONSORT_LAYER_actors_DIRS actors)
set(CONSORT_LAYER_testing_DIRS testing)

# Public headers, #include <consort/...>, by the layer that implements them. A public header must
# be listed here (the check fails on one that is not), and it is checked with its layer's rules.
set(CONSORT_LAYER_core_HEADERS
  asio.hpp caf_error.hpp clock_offset.hpp collective_kind.hpp config.hpp error.hpp future.hpp
  per_replica.hpp reduce_op.hpp)
set(CONSORT_LAYER_device_HEADERS checkpoint.hpp device.hpp nest.hpp ops.hpp tensor.hpp)
set(CONSORT_LAYER_cluster_HEADERS cluster.hpp)
set(CONSORT_LAYER_transport_HEADERS
  transport/algorithms.hpp transport/local.hpp transport/membership.hpp transport/pair.hpp
  transport/shm.hpp transport/tcp.hpp)
set(CONSORT_LAYER_actors_HEADERS
  consort.hpp cross_device_ops.hpp dataset.hpp elastic.hpp regroup.hpp optimizer.hpp replica_context.hpp
  strategy.hpp stragglers.hpp variable.hpp)
set(CONSORT_LAYER_testing_HEADERS testing.hpp)
