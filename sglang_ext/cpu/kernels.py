"""Pure-torch versions of the `sgl_kernel` CPU ops that SGLang's plain and DFlash paths call.

Each function keeps the kernel's exact signature (SGLang calls it positionally) and is the
reference for the GPU kernel's contract. They are vectorised (no per-request Python loop)
because they sit on the decode hot path.
"""
from __future__ import annotations

import ctypes
import importlib
import sys

import torch


def _ragged(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ranges [starts[i], ends[i]), return (range index, column) of every element, in order."""
    lens = (ends - starts).long()
    which = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    cols = torch.arange(int(lens.sum()), device=lens.device) - first[which] + starts.long()[which]
    return which, cols


def _ranges(req_pool_indices: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
    """(rows, cols) indexing req_to_token at every [starts[i], ends[i]) of row req_pool_indices[i], packed in order.

    Why not always _ragged: a decode step's ranges all have one length (the reservation, the verify window), and
    a [bs, n] grid is 3 small ops where the ragged form is 8, which a width-1 step would pay every step."""
    lo, hi = starts.tolist(), ends.tolist()
    n = hi[0] - lo[0] if lo else 0
    if all(e - s == n for s, e in zip(lo, hi)):
        cols = starts.long().unsqueeze(1) + torch.arange(n, device=starts.device)
        return req_pool_indices.long().unsqueeze(1).expand(-1, n).reshape(-1), cols.reshape(-1)
    which, cols = _ragged(starts, ends)
    return req_pool_indices.long()[which], cols


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """Called by mem_cache/allocation.py `assign_req_to_token_pool_func` on CPU:
    req_to_token[r_i, start_i:end_i] = the next (end_i - start_i) entries of out_cache_loc."""
    rows, cols = _ranges(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, cols] = out_cache_loc[: cols.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """Called by kernels/ops/speculative/cache_locs.py (DFlash verify/draft locations):
    the inverse gather, out_cache_loc (packed) = req_to_token[r_i, start_i:end_i]."""
    rows, cols = _ranges(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: cols.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """Called by kernels/ops/kvcache/cache_move.py `copy_all_layer_kv_cache_func` (DFlash
    compacts draft KV rows): for every KV buffer i (raw address data_ptrs[i], row of
    strides[i] bytes), copy row src_loc[j] to row tgt_loc[j]. The kernel's contract is raw
    pointers, so the rows are viewed through ctypes without copying the buffer."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced-index read makes a copy first: overlapping moves are safe


IMPLEMENTED = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
}


def bind() -> list[str]:
    """Put the implementations on the `sgl_kernel` stub (no-op when a real sgl_kernel is installed)."""
    from sglang_ext.cpu.stubs import is_stub

    mod = sys.modules.get("sgl_kernel")
    if mod is None or not is_stub(mod):
        return []
    for name, fn in IMPLEMENTED.items():
        setattr(mod, name, fn)
    from sglang_ext.cpu import gdn

    mamba = importlib.import_module("sgl_kernel.mamba")
    for name, fn in gdn.MAMBA_MODULE.items():
        setattr(mamba, name, fn)
    # SGLang reads these as `torch.ops.sgl_kernel.<name>` attributes at import; an attribute on the namespace
    # answers first (there is no CPU sgl_kernel library to register them from)
    for name, fn in gdn.TORCH_OPS.items():
        setattr(torch.ops.sgl_kernel, name, fn)
    return sorted([*IMPLEMENTED, *gdn.MAMBA_MODULE, *gdn.TORCH_OPS])
