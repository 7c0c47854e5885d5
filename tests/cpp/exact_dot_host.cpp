// Host harness for src/include/dsaquant/exact_dot.h (tests/test_exact_dot_host.py).
// stdin (little endian): int32 H, int32 N, uint8 q[H*64], uint32 qexp[H], float w[H],
// then N records of uint8 k[64], uint32 kexp. stdout: the N fp32 logits (dsq::exact_logit).
#include <cstdio>
#include <vector>

#include "dsaquant/exact_dot.h"

int main() {
  int H = 0, N = 0;
  if (fread(&H, 4, 1, stdin) != 1 || fread(&N, 4, 1, stdin) != 1 || H < 4 || H > 128) return 2;
  std::vector<uint8_t> q(64 * H);
  std::vector<uint32_t> qexp(H);
  std::vector<float> w(H);
  if (fread(q.data(), 1, q.size(), stdin) != q.size()) return 3;
  if (fread(qexp.data(), 4, H, stdin) != static_cast<size_t>(H)) return 3;
  if (fread(w.data(), 4, H, stdin) != static_cast<size_t>(H)) return 3;
  for (int n = 0; n < N; ++n) {
    uint8_t k[64];
    uint32_t kexp = 0;
    if (fread(k, 1, 64, stdin) != 64 || fread(&kexp, 4, 1, stdin) != 1) return 4;
    const float logit = dsq::exact_logit(q.data(), qexp.data(), w.data(), H, k, kexp);
    fwrite(&logit, 4, 1, stdout);
  }
  return 0;
}
