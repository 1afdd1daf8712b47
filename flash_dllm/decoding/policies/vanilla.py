"""``vanilla``: LLaDA's low-confidence remasking, the exact reference sampler. Each step commits
the ``k`` most confident masked slots of the block, ``k`` from the step schedule
(``decoding/schedule.py``: the block's masks spread over ``steps_per_block`` steps)."""
from __future__ import annotations

from flash_dllm.decoding.policies.base import DecodePolicy
from flash_dllm.decoding.policies.rules import select_top_k, top_k_rows
from flash_dllm.decoding.schedule import transfer_count


class VanillaPolicy(DecodePolicy):
    name = "vanilla"
    fusable = True
    reads_steps = True
    # k follows the step within the block (the schedule)
    fused_static_per_block = False

    def select(self, ctx, members):
        b = ctx.batch
        ctx.keep |= select_top_k(ctx.conf, ctx.positions, [ctx.bounds[i] for i in members],
                                 [transfer_count(b[i]) for i in members],
                                 [b[i].canvas_len for i in members])

    # NOTE (fused): requests are grouped by (canvas length, k) as ``select_top_k`` groups them
    # (the same topk calls on the same shapes, hence the same tie order); the groups are part of
    # the graph's key and ``perm`` lists the batch rows group by group
    def fused_signature(self, req) -> int:
        return min(transfer_count(req), req.num_masked)

    def fused_ahead(self, req, limit):
        # each step commits exactly min(k, masked): the block's next steps are known until the
        # step that leaves no MASK (``Request._advance``: a block ends, or the request finishes,
        # only when its last MASK is committed)
        masked, step, out = req.num_masked, req.step_in_block, []
        while len(out) < limit:
            masked -= min(transfer_count(req, step), masked)
            step += 1
            if masked <= 0:
                break
            out.append((min(transfer_count(req, step), masked), masked))
        return out

    def fused_fields(self, batch, signature, dims):
        by: dict[tuple[int, int], list[int]] = {}
        for b, (r, k) in enumerate(zip(batch, signature)):
            by.setdefault((r.canvas_len, k), []).append(b)
        groups, a = [], 0
        for (length, k), members in by.items():
            groups.append((length, k, a, a + len(members)))
            a += len(members)
        B = len(batch)
        return (tuple(groups), tuple(b for members in by.values() for b in members)), \
            [("perm", B)]

    def fill_fused(self, host, sl, batch, signature, arena_rows):
        key, _ = self.fused_fields(batch, signature, None)
        host[sl["perm"]] = key[1]

    def fused_keep(self, conf, masked, inp, sl, key):
        return top_k_rows(conf, masked, inp[sl["perm"]], inp[sl["bstart"]], key[0])
