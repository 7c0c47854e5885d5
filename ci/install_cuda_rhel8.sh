#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler and static runtime from NVIDIA's RHEL 8 package repository, in a manylinux_2_28
# image (AlmaLinux 8, glibc 2.28, the base of the manylinux_2_28 wheels): $1 = x86_64, or sbsa for arm64 servers
# (GH200, GB200). Default: the machine's. nvcc ends up in /usr/local/cuda-13.0/bin.
set -euo pipefail
arch=${1:-$( [ "$(uname -m)" = aarch64 ] && echo sbsa || echo x86_64 )}
curl -fsSL -o /etc/yum.repos.d/cuda-rhel8.repo \
  "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/$arch/cuda-rhel8.repo"
dnf install -y -q cuda-nvcc-13-0 cuda-cudart-devel-13-0 cuda-cccl-13-0 cuda-cuobjdump-13-0
/usr/local/cuda-13.0/bin/nvcc --version
