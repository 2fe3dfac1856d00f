"""The accept/bonus output buffers of the adaptive worker: sized for the trained block whatever width allocates them,
and upstream's Triton accept kernel (run by Triton's interpreter) writes every width's result into them.

Upstream's DFlashWorkerV2._ensure_accept_bonus_buffers sizes out_tokens [cap, self.block_size], and the adaptive
worker sets self.block_size to the verify width around the accept: without the worker's override the buffers took
the width of the step that first allocated them, and a wider step made the Triton accept kernel write past them
(tests/integration/test_triton_kernels.py runs it through a real server). Here upstream's real allocation methods
run through the worker's overrides, on a worker holding only the fields they read, in a child process with the CPU
layer's import stubs and TRITON_INTERPRET=1; the kernel's output is compared with upstream's eager accept.
"""
from __future__ import annotations

import json

from tests.conftest import child_result

B = 16
STEPS = [(3, 1), (3, 16), (5, 4), (7, 16), (2, 1), (7, 8), (9, 2)]  # (batch, width): shrink, grow, batch grows

PROBE = r"""
import json, sys
import torch
from sglang.kernels.ops.speculative.dflash import _compute_dflash_accept_bonus_triton_unchecked as accept_triton
from sglang.kernels.ops.speculative.dflash import compute_dflash_correct_drafts_and_bonus as accept_eager
from sglang_ext.worker import AdaptiveDFlashWorker

B, steps = int(sys.argv[1]), json.loads(sys.argv[2])
w = object.__new__(AdaptiveDFlashWorker)
w.device, w.max_block, w.block_size = "cpu", B, B
w._accept_bonus_buffer_cap, w._accept_bonus_buffer_slot = 0, 0
w._accept_len_buf, w._commit_lens_bufs, w._bonus_id_bufs = None, [], []
w._out_tokens_bufs, w._new_seq_lens_bufs = [], []
gen = torch.Generator().manual_seed(0)
out = []
for bs, width in steps:
    w.block_size = width  # as steps/accept.py sets it around the accept
    try:
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = w._next_accept_bonus_buffers(bs)
    finally:
        w.block_size = w.max_block
    cand = torch.randint(0, 3, (bs, width), generator=gen)
    target = torch.randint(0, 3, (bs, width), generator=gen)
    prefix = torch.randint(5, 50, (bs,), generator=gen)
    accept_triton(candidates=cand, target_top1=target, accept_lens_out=accept_len, commit_lens_out=commit_lens,
                  bonus_ids_out=bonus, out_tokens_out=out_tokens, prefix_lens=prefix, new_seq_lens_out=new_seq_lens)
    ref_accept, ref_bonus = accept_eager(candidates=cand, target_predict=target)
    committed_ok = all(out_tokens[r, : int(accept_len[r]) + 1].tolist()
                       == cand[r, 1 : int(accept_len[r]) + 1].tolist() + [int(ref_bonus[r])] for r in range(bs))
    storage = {b.untyped_storage().data_ptr() for b in w._out_tokens_bufs}
    out.append({"shape": list(out_tokens.shape), "contiguous": out_tokens.is_contiguous(),
                "view_of_buffer": out_tokens.untyped_storage().data_ptr() in storage,
                "buffer_shapes": [list(b.shape) for b in w._out_tokens_bufs], "cap": w._accept_bonus_buffer_cap,
                "width_restored": w.block_size == B,
                "accept_ok": accept_len.tolist() == ref_accept.tolist() and bonus.tolist() == ref_bonus.tolist(),
                "committed_ok": committed_ok,
                "seq_lens_ok": new_seq_lens.tolist() == (prefix + accept_len.long() + 1).tolist()})
print("RESULT" + json.dumps(out))
"""


def test_every_width_after_a_narrow_first_allocation_gets_a_buffer_view_and_a_correct_triton_accept():
    results = child_result("-c", PROBE, str(B), json.dumps(STEPS), TRITON_INTERPRET="1")
    for (bs, width), got in zip(STEPS, results, strict=True):
        where = f"batch {bs}, width {width}"
        assert got["shape"] == [bs, width] and got["contiguous"] and got["view_of_buffer"], (where, got)
        assert all(s == [got["cap"], B] for s in got["buffer_shapes"]), (where, got)  # sized for B, never b
        assert got["width_restored"], where
        assert got["accept_ok"] and got["committed_ok"] and got["seq_lens_ok"], (where, got)
