"""The torch reference of docs/spec.md: the oracle every backend is held to, byte for byte.

Runs on CPU and GPU tensors. Modules: `arith` (§0), `fp4` (§1-§3), `fp8` (§4), `transforms` (§5),
`layouts` (§6), `ops` (§7.1-§7.3, §7.6-§7.7), `scorer` (§7.4).
"""
