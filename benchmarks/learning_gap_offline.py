"""Where the gate's original-mix figure and serving's part, step 1 (offline): a candidate drafter as the learner makes
one -- the bundled drafter fine-tuned on the target's greedy answers to prose chat prompts (learning_ab.py's prose
workload), `share` of each batch from the original mix -- and the gate's figures (gate.measure) for the bundled
drafter, the candidate as trained (float32) and the candidate as saved and served (bfloat16), on the gate's own
original-mix slice (the bundled pair's held-out stdlib prompts, as the learner builds it) and on held-out prose.

    GAP_DIR=/tmp/learning_gap python benchmarks/learning_gap_offline.py [steps=30] [share=0.25]

Writes GAP_DIR/cand (the candidate, saved as a promotion is), GAP_DIR/orig_eval.pt (the gate's slice) and
GAP_DIR/offline.json. Step 2: learning_gap_serve.py.
"""
import copy, json, os, sys, time, random
from pathlib import Path
import torch
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]; sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from dflash_models.learn.distill import Pair, FinetuneSpec, finetune, load_drafter, save_drafter, original_mix
from dflash_models.learn import gate
from learning_ab import dataset
out = Path(os.environ.get("GAP_DIR", "/tmp/learning_gap")); steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
share = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
t0 = time.time()
pair = Pair(REPO / "models/tiny-code/target")
base, cfg = load_drafter(REPO / "models/tiny-code/drafter")
L = list(cfg["dflash_config"]["target_layer_ids"])
tok = pair.tokenizer
prose = dataset("prose", 160, 5)
from dflash_models.learn import dataset as ds
enc = ds.encode(prose, tok, 192)
pt, ps = original_mix(pair, 0, "", 0, 64, out / "prose.pt", prompts=enc)
otr = original_mix(pair, 96, "train", 11, 96, out / "orig_train.pt", max_prompt_tokens=192)
oev = original_mix(pair, 128, "heldout", 12, 96, out / "orig_eval.pt", max_prompt_tokens=192)
print("gen", time.time() - t0, flush=True)
prose_items = pair.items(pt, ps, L, log=lambda *_: None)
train_p, held_p = prose_items[:128], prose_items[128:]
orig_train = pair.items(*otr, L, log=lambda *_: None); orig_eval = pair.items(*oev, L, log=lambda *_: None)
cand = copy.deepcopy(base)
finetune(cand, pair, train_p, orig_train, FinetuneSpec(steps=steps, original_share=share))
print("ft", time.time() - t0, flush=True)
save_drafter(cand, cfg, out / "cand", REPO / "models/tiny-code/target")
torch.save(cand.state_dict(), out / "cand_fp32.pt")
cand16, _ = load_drafter(out / "cand")
e, h = pair.embed, pair.head_w
res = {}
for name, m in (("base", base), ("cand_fp32", cand), ("cand_bf16", cand16)):
    res[name] = {"original": gate.measure(m, e, h, orig_eval)["all"].summary(),
                 "prose": gate.measure(m, e, h, held_p)["all"].summary()}
    print(name, res[name]["original"]["tokens_per_step"], res[name]["prose"]["tokens_per_step"], flush=True)
(out / "offline.json").write_text(json.dumps(res, indent=1))
print("done", time.time() - t0)
