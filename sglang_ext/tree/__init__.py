"""DDTree tree verification, its tensor logic (torch only, no SGLang): build.py (the tree from the drafter's
marginals), walk.py (the accept: the committed path), mask.py (who attends to whom in the tree verify)."""
