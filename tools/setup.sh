#!/usr/bin/env bash
# Installs what consort needs to build and test on Debian 12 (as root, or with sudo).
# Packages already present are left alone, so running it twice costs a dpkg query.
set -euo pipefail

packages=(
  g++ cmake ninja-build pkg-config git
  libcaf-dev        # CAF 0.17.6 actors (core + io)
  libboost-dev      # Boost.Asio (header-only): completion tokens, later the TCP transport
  libgtest-dev      # GoogleTest
  nlohmann-json3-dev # TF_CONFIG parsing in cluster/ (header-only, build time only)
  libcapnp-dev      # Cap'n Proto 0.9: membership and frame-header schemas (needs pkg-config)
  capnproto         # the capnp schema compiler
  libssl-dev        # OpenSSL 3 libcrypto: HMAC-SHA256 and nonces of authenticated connections
  clang-format      # the format check of tools/test.sh
  iproute2          # `ip netns` for the multi-worker test on distinct addresses (tests/multiworker)
  libeigen3-dev     # Eigen 3.4 (header-only): the float32 GEMMs of the training demo (examples/train)
  openmpi-bin       # Open MPI 4.1's mpirun: the multi-worker test under a real mpirun (tests/multiworker)
  libopenmpi-dev    # Open MPI's headers: a user's MPI program with consort, checked against MPI (tests/multiworker)
  slurmctld         # Slurm 22.05's controller: a one-node Slurm under srun (tests/multiworker/slurm_test.sh)
  slurmd            # Slurm's node daemon, for the same test
  slurm-client      # srun, scontrol, sinfo, squeue, scancel, for the same test
  zlib1g-dev        # zlib: gzip'd data files of the training demo (consort-train --data FILE.csv.gz)
  python3-sklearn   # only for its data file sklearn/datasets/data/digits.csv.gz: the demo's real data (tests/train)
  python3-numpy     # the numpy reader of consort's checkpoint files (tests/core, docs/checkpoints.md)
  libcli11-dev      # CLI11 (header-only): the command lines of the demo and the benchmarks (examples/common/cli.hpp)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
echo "setup: installing ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
