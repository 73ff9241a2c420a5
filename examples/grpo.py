"""A small GRPO loop beside a running pagefleet engine: rollouts, rewards, a policy-gradient step, new weights pushed
into the engine, and a check that the next rollouts come from them.

The engine (`LLM`) runs in this process; the trainer (the transformers model of the same checkpoint folder, AdamW)
runs in a child process with its own copy of the weights, as a trainer beside an inference engine does. Each step:

1. rollouts: P arithmetic prompts x n samples at temperature 1 (seeded), with the sampled tokens' logprobs;
2. rewards: 1 for the right sum, 0.2 for some other number, 0 for none; advantages normalised within each group
   of n samples of one prompt (GRPO; no KL term, one on-policy gradient step, so the PPO ratio is 1);
3. the trainer recomputes the log-probs of the sampled tokens itself (their mismatch with the engine's is
   printed), takes one AdamW step on -mean(advantage x mean token log-prob), and pushes its weights:
   through CUDA IPC handles on a GPU (update_weights_from_tensor), the tensors themselves on the CPU, or with
   --broadcast over a torch.distributed group (trainer rank 0, engine rank 1; gloo on the CPU, NCCL on GPUs);
4. the check: the engine's log-probs of a fixed probe sequence equal the trainer's new-policy log-probs within
   --tol, differ from the previous version's by more than that, and the engine's weight_version moved by one.

On a GPU the engine takes --gpu-memory-fraction 0.35 and each step's generation is also timed against
transformers `generate()` on the same prompts (bf16 copy of the policy, same n, temperature and length cap).

    python examples/grpo.py --steps 2 --device cpu --broadcast     # CI: the bundled SmolLM2-135M
    python examples/grpo.py --steps 8 --device cuda                # H200: IPC updates, timing table
"""

from __future__ import annotations

import argparse
import random
import re
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

SYSTEM = "Answer with a number."  # short: the prompt tokens are trained over on CPU too
PROBE = "What is 2 plus 3?"
NUMBER = re.compile(r"-?\d+")


# ---- the task: sums of two small numbers, checked by a program


def make_prompts(rng: random.Random, count: int) -> list[tuple[str, int]]:
    pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(count)]
    return [(f"What is {a} plus {b}?", a + b) for a, b in pairs]


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def reward(text: str, answer: int) -> float:
    m = NUMBER.search(text)
    if m is None:
        return 0.0
    return 1.0 if int(m.group()) == answer else 0.2


def group_advantages(rewards: list[float], n: int) -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of n samples of one prompt."""
    out = []
    for g in range(0, len(rewards), n):
        r = torch.tensor(rewards[g:g + n])
        out += ((r - r.mean()) / (r.std(unbiased=False) + 1e-4)).tolist()
    return out


# ---- the trainer (child process)


def token_logprobs(model, sequences: list[tuple[list[int], list[int]]], device) -> list[torch.Tensor]:
    """log p(completion token | everything before it) for each (prompt ids, completion ids), with grad."""
    lengths = [len(p) + len(c) for p, c in sequences]
    width = max(lengths)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, (p, c) in enumerate(sequences):
        ids[i, :lengths[i]] = torch.tensor(p + c)
        mask[i, :lengths[i]] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    out = []
    for i, (p, c) in enumerate(sequences):
        rows = logits[i, len(p) - 1:len(p) + len(c) - 1].float()  # the rows that predict the completion
        out.append(torch.log_softmax(rows, -1).gather(1, torch.tensor(c, device=device)[:, None])[:, 0])
    return out


class Trainer:
    def __init__(self, args, device: torch.device):
        from transformers import AutoModelForCausalLM

        self.args, self.device = args, device
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
        self.model.config.use_cache = False
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0)
        self.hf_gen = None
        if args.compare_hf:  # generation in the engine's dtype, so the timing compares like with like
            self.hf_gen = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device).eval()

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights under their checkpoint names (a tied lm_head is the embedding: sent once)."""
        return [(name, p.detach()) for name, p in self.model.named_parameters()]

    def step(self, rollouts: list[dict]) -> dict:
        self.model.train()
        advantages = group_advantages([r["reward"] for r in rollouts], self.args.n)
        seqs = [(r["prompt_ids"], r["token_ids"]) for r in rollouts]
        logps = token_logprobs(self.model, seqs, self.device)
        mismatch = max(float((lp.detach().cpu() - torch.tensor(r["logprobs"])).abs().max())
                       for lp, r in zip(logps, rollouts))
        loss = -torch.stack([a * lp.mean() for a, lp in zip(advantages, logps)]).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.opt.step()
        return {"loss": loss.item(), "mismatch": mismatch, "grad_norm": grad_norm}

    @torch.no_grad()
    def probe_logprobs(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        self.model.eval()
        return token_logprobs(self.model, [(prompt_ids, token_ids)], self.device)[0].cpu().tolist()

    @torch.no_grad()
    def time_hf_generate(self, prompt_ids: list[list[int]], seed: int) -> tuple[float, int]:
        """transformers generate() on the same prompts: n samples each at temperature 1, same length cap."""
        self.hf_gen.load_state_dict({k: v.to(torch.bfloat16) for k, v in self.model.state_dict().items()})
        width = max(len(p) for p in prompt_ids)
        pad = self.hf_gen.config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else pad
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left padding, as decoder-only generation wants
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        torch.manual_seed(seed)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.hf_gen.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=self.args.max_tokens, num_return_sequences=self.args.n,
                                   pad_token_id=pad)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        new = out[:, width:]
        tokens = int((new != pad).sum()) + int((new == pad).any(1).sum())  # the eos of each finished sample
        return seconds, tokens


def trainer_main(args, conn) -> None:
    """The trainer process: answers (command, payload) messages from the engine's process."""
    device = torch.device(args.device)
    if args.broadcast and device.type == "cuda":  # NCCL wants each rank on its own GPU; the engine has cuda:0
        device = torch.device("cuda", 1)
    trainer = Trainer(args, device)
    broadcaster = None
    if args.broadcast:
        from pagefleet.worker.executor.weight_transfer import WeightBroadcaster

        broadcaster = WeightBroadcaster("127.0.0.1", args.master_port, world_size=2,
                                        backend="nccl" if device.type == "cuda" else "gloo", device=device)
    conn.send(("ready", None))
    while True:
        command, payload = conn.recv()
        if command == "stop":
            return
        if command == "train":
            conn.send(("trained", trainer.step(payload)))
        elif command == "probe":
            conn.send(("probe", trainer.probe_logprobs(*payload)))
        elif command == "hf_generate":
            conn.send(("hf_generate", trainer.time_hf_generate(*payload)))
        elif command == "push":
            named = trainer.named_weights()
            if broadcaster is not None:
                # the engine is told the names, dtypes and shapes, then both sides join the broadcast
                conn.send(("meta", ([n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named],
                                    [list(t.shape) for _, t in named])))
                broadcaster.broadcast(named)
            elif device.type == "cuda":
                from pagefleet.worker.executor.weight_transfer import serialize_named_tensors

                conn.send(("ipc", serialize_named_tensors(named)))
                conn.recv()  # the engine has copied them: our tensors may change again
            else:
                conn.send(("tensors", [(n, t.clone()) for n, t in named]))
            conn.send(("pushed", None))


# ---- the engine's side (this process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loop:
    def __init__(self, args):
        from pagefleet.worker import LLM
        from pagefleet.worker.core.sampling_params import SamplingParams

        self.args, self.SamplingParams = args, SamplingParams
        engine_args = dict(device=args.device, max_model_len=512, seed=args.seed)
        if args.device.startswith("cuda"):
            engine_args["gpu_memory_fraction"] = args.gpu_memory_fraction
        else:
            engine_args["kv_cache_memory_bytes"] = 64 << 20
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        if args.broadcast:
            args.master_port = free_port()
        self.proc = ctx.Process(target=trainer_main, args=(args, child), daemon=True)
        self.proc.start()
        self.llm = LLM(args.model, **engine_args)
        if args.broadcast:  # joins the trainer's group: rank 0 is the trainer, this engine rank 1
            self.llm.init_weights_update_group("127.0.0.1", args.master_port, rank_offset=1, world_size=2,
                                               backend="nccl" if args.device.startswith("cuda") else "gloo")
        self.expect("ready")
        self.rng = random.Random(args.seed)
        self.probe_ids = self.llm.chat_prompt_ids(chat(PROBE))
        # the probe: the starting policy's greedy answer, scored by every later policy
        first = self.llm.generate([self.probe_ids], SamplingParams(temperature=0.0, max_tokens=args.probe_tokens,
                                                                   ignore_eos=True))[0]
        self.probe_tokens = first.outputs[0].token_ids

    def expect(self, want: str):
        got, payload = self.conn.recv()
        if got != want:
            raise RuntimeError(f"trainer answered {got!r}, expected {want!r}")
        return payload

    def ask(self, command: str, payload=None):
        self.conn.send((command, payload))
        return self.expect({"train": "trained"}.get(command, command))

    def engine_probe(self) -> list[float]:
        """The engine's log-probs of the probe tokens: one greedy step per prefix, read from its top 20."""
        prompts = [self.probe_ids + self.probe_tokens[:i] for i in range(len(self.probe_tokens))]
        outs = self.llm.generate(prompts, self.SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))
        lps = []
        for out, token in zip(outs, self.probe_tokens):
            entry = out.outputs[0].logprobs[0]
            top = dict(entry.top)
            top[entry.token_id] = entry.logprob
            if token not in top:
                raise AssertionError(f"probe token {token} fell out of the engine's top 20: the policy moved far")
            lps.append(top[token])
        return lps

    def rollouts(self, step: int) -> tuple[list[dict], list[list[int]], float]:
        a = self.args
        prompts = make_prompts(self.rng, a.prompts)
        ids = [self.llm.chat_prompt_ids(chat(q)) for q, _ in prompts]
        params = [self.SamplingParams(n=a.n, temperature=1.0, seed=a.seed + 1000 * step + i, max_tokens=a.max_tokens,
                                      logprobs=0) for i in range(len(prompts))]
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = self.llm.generate(ids, params)
        seconds = time.perf_counter() - start
        rollouts = []
        for (_, answer), p_ids, out in zip(prompts, ids, outs):
            assert out.weight_version == self.llm.weight_version, "a rollout from another weight version"
            for o in sorted(out.outputs, key=lambda o: o.index):
                assert len(o.logprobs) == len(o.token_ids)
                rollouts.append({"prompt_ids": p_ids, "token_ids": list(o.token_ids), "reward": reward(o.text, answer),
                                 "logprobs": [e.logprob for e in o.logprobs]})
        return rollouts, ids, seconds

    def push(self) -> float:
        """The trainer's weights into the engine; returns the seconds the engine spent taking them."""
        self.conn.send(("push", None))
        got, payload = self.conn.recv()
        start = time.perf_counter()
        if got == "meta":
            self.llm.update_weights_from_distributed(*payload)
        elif got == "ipc":
            from pagefleet.worker.executor.weight_transfer import deserialize_named_tensors

            self.llm.update_weights_from_tensor(deserialize_named_tensors(payload))
            seconds = time.perf_counter() - start
            self.conn.send(("copied", None))
            self.expect("pushed")
            return seconds
        elif got == "tensors":
            self.llm.update_weights_from_tensor(payload)
        else:
            raise RuntimeError(f"trainer answered {got!r} to push")
        seconds = time.perf_counter() - start
        self.expect("pushed")
        return seconds

    def run(self) -> list[dict]:
        a = self.args
        rows = []
        previous = self.engine_probe()
        start_version = self.llm.weight_version
        base = self.ask("probe", (self.probe_ids, self.probe_tokens))
        base_err = max(abs(e - t) for e, t in zip(previous, base))
        print(f"weight_version {start_version}: probe engine vs trainer {base_err:.2e} (same checkpoint)", flush=True)
        if base_err > a.tol:
            raise AssertionError(f"engine and trainer disagree by {base_err:.3e} > tol {a.tol} before any update")
        for step in range(a.steps):
            rollouts, ids, gen_s = self.rollouts(step)
            gen_tokens = sum(len(r["token_ids"]) for r in rollouts)
            stats = self.ask("train", rollouts)
            push_s = self.push()
            version = self.llm.weight_version
            assert version == start_version + step + 1, f"weight_version {version} after {step + 1} updates"
            engine_lp = self.engine_probe()
            trainer_lp = self.ask("probe", (self.probe_ids, self.probe_tokens))
            err = max(abs(e - t) for e, t in zip(engine_lp, trainer_lp))
            moved = max(abs(e - p) for e, p in zip(engine_lp, previous))
            previous = engine_lp
            row = {"step": step, "reward": sum(r["reward"] for r in rollouts) / len(rollouts), **stats,
                   "gen_s": gen_s, "gen_tokens": gen_tokens, "push_s": push_s, "version": version,
                   "probe_err": err, "probe_moved": moved}
            if a.compare_hf:
                hf_s, hf_tokens = self.ask("hf_generate", (ids, a.seed + 1000 * step))
                row.update(hf_s=hf_s, hf_tokens=hf_tokens)
            rows.append(row)
            print(f"step {step}: reward {row['reward']:.3f} loss {row['loss']:+.4f} "
                  f"rollout mismatch {row['mismatch']:.2e} | push {push_s * 1e3:.0f} ms -> weight_version {version} | "
                  f"probe: engine vs trainer {err:.2e}, moved {moved:.2e}", flush=True)
            if err > a.tol:
                raise AssertionError(f"step {step}: the engine's probe log-probs differ from the trainer's new "
                                     f"policy by {err:.3e} > tol {a.tol}: rollouts would not come from the new weights")
            if moved <= err:
                raise AssertionError(f"step {step}: the probe moved by {moved:.3e}, not more than the engine-trainer "
                                     f"difference {err:.3e}: the check cannot tell old weights from new (raise --lr)")
        return rows

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.proc.join(30)


def print_table(rows: list[dict]) -> None:
    print("\nstep | samples | pagefleet s | tok/s     | transformers s | tok/s   | speed-up")
    for r in rows:
        ours = r["gen_tokens"] / r["gen_s"]
        hf = r["hf_tokens"] / r["hf_s"]
        print(f"{r['step']:4d} | {r['gen_tokens']:7d} | {r['gen_s']:11.3f} | {ours:9.0f} | {r['hf_s']:14.3f} | "
              f"{hf:7.0f} | {r['hf_s'] / r['gen_s']:7.1f}x")
    total_ours = sum(r["gen_s"] for r in rows)
    total_hf = sum(r["hf_s"] for r in rows)
    print(f"all  |         | {total_ours:11.3f} |           | {total_hf:14.3f} |         | "
          f"{total_hf / total_ours:7.1f}x (generation time per step, same prompts, n, temperature, length cap)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--broadcast", action="store_true",
                   help="push weights over a torch.distributed group (trainer rank 0) instead of tensors / IPC")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 1 on CPU, 32 on GPU)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (one GRPO group)")
    p.add_argument("--max-tokens", type=int, default=None, help="length cap (default: 8 on CPU, 128 on GPU)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 1e-5 CPU, 3e-5 GPU)")
    p.add_argument("--tol", type=float, default=None,
                   help="max |engine - trainer| probe log-prob (default: 1e-3 in float32 on CPU, 0.15 bf16 on GPU)")
    p.add_argument("--probe-tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-fraction", type=float, default=0.35, help="the engine's share of the GPU")
    p.add_argument("--compare-hf", action=argparse.BooleanOptionalAction, default=None,
                   help="time transformers generate() on the same prompts (default: on a GPU)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device.startswith("cuda")
    if args.model is None:
        from pagefleet.worker.models.loader import bundled_model_path

        args.model = str(bundled_model_path())
    args.prompts = args.prompts or (32 if gpu else 1)
    args.max_tokens = args.max_tokens or (128 if gpu else 8)
    args.lr = args.lr or (3e-5 if gpu else 1e-5)
    args.tol = args.tol if args.tol is not None else (0.15 if gpu else 1e-3)
    args.compare_hf = gpu if args.compare_hf is None else args.compare_hf
    if args.compare_hf and not gpu:
        p.error("--compare-hf times generation on a GPU")
    if args.broadcast and gpu and torch.cuda.device_count() < 2:
        p.error("NCCL refuses two ranks on one GPU: --broadcast on CUDA needs two GPUs (use the IPC default)")
    if args.steps < 1 or args.n < 2:
        p.error("--steps must be >= 1 and --n >= 2 (advantages are relative within a group)")
    loop = Loop(args)
    try:
        rows = loop.run()
    finally:
        loop.close()
    if args.compare_hf:
        print_table(rows)
    print(f"ok: {args.steps} GRPO steps; after each update the engine's log-probs matched the trainer's new policy "
          f"(max {max(r['probe_err'] for r in rows):.2e} <= tol {args.tol}); weight_version {rows[-1]['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
