"""specengine as the generation backend of TRL's ``GRPOTrainer`` (``trl==1.16.0``).

TRL's smallest supported hook for an outside engine is ``GRPOTrainer(rollout_func=f)``: with
``use_vllm=False``, ``f(prompts, trainer)`` replaces the trainer's own generation. ``prompts``
is this process's slice of the generation batch, already repeated ``num_generations`` times
(TRL's ``RepeatSampler`` puts a prompt's copies next to each other), and ``f`` returns one
completion per entry: ``{"prompt_ids", "completion_ids", "logprobs"}`` plus any extra
per-entry fields, which TRL hands to the reward functions as keyword arguments.

``RolloutFunc`` is that ``f``, bound to one ``specengine.LLM``. Each call it

1. pushes ``trainer.model``'s parameters into the engine (``LLM.update_weights``) when the
   trainer's ``global_step`` differs from the step last pushed (TRL's own vLLM path does the
   same with its ``_last_loaded_step``; the first call always pushes);
2. tokenizes the prompts exactly as ``GRPOTrainer._tokenize_prompts`` does (conversations
   through ``apply_chat_template`` with the trainer's tools, template and
   ``chat_template_kwargs``; text through the processing class), so the prompt ids are the
   ones the trainer scores;
3. generates every run of identical consecutive prompts as one request with ``n`` = the run's
   length, with the trainer's ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
   ``max_completion_length``, ``logprobs=0`` and a seed derived from
   ``(seed, process index, global step, call, run)``, so a rerun samples the same tokens;
4. returns the ids, the sampled token's logprob per completion token (the engine should run
   with ``logprobs_mode="processed_logprobs"``, the distribution actually sampled from, as TRL
   configures vLLM), and per entry ``finish_reason`` and ``weight_version``.

TRL 1.16 applies its importance-sampling correction (``vllm_importance_sampling_correction``)
only when ``use_vllm=True``, which needs vLLM installed, so with this hook the returned
logprobs reach the trainer but its loss does not use them.

Usage::

    from specengine import LLM
    from specengine.integrations.trl import RolloutFunc
    llm = LLM("smollm2-135m-instruct", dtype="float32", logprobs_mode="processed_logprobs",
              speculative_config={"method": "eagle"})
    trainer = GRPOTrainer(model=hf_model, reward_funcs=reward, args=GRPOConfig(...),
                          train_dataset=ds, processing_class=tokenizer,
                          rollout_func=RolloutFunc(llm))
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import asdict, dataclass

import trl
from transformers import TrainerCallback
from trl.data_utils import is_conversational

from specengine.sampling.params import SamplingParams

TESTED_TRL_VERSION = "1.16.0"


@dataclass
class RolloutStats:
    """What one ``RolloutFunc`` call did.

    Attributes:
        step: the trainer's ``global_step`` at the call.
        num_prompts: distinct prompt runs generated (requests sent to the engine).
        num_completions: completions returned (= entries in ``prompts``).
        synced: whether the weights were pushed before generating.
        sync_seconds: wall seconds of the push (0.0 when not synced).
        generate_seconds: wall seconds of ``LLM.generate``.
        weight_version: ``RolloutFunc.weight_version`` after the push.
        generated_tokens: completion tokens the engine committed during the call.
        spec_steps: speculative verify steps (one per sequence per verifying step).
        accepted_tokens: draft tokens accepted in them.
        tau: tokens committed per verify step, ``(accepted + spec_steps) / spec_steps``
            (None when no step speculated).
        tokens_per_forward: completion tokens per target forward over all the call's
            sequences, speculating or not (1.0 means plain decoding).
    """

    step: int
    num_prompts: int
    num_completions: int
    synced: bool
    sync_seconds: float
    generate_seconds: float
    weight_version: int
    generated_tokens: int
    spec_steps: int
    accepted_tokens: int
    tau: float | None
    tokens_per_forward: float

    def as_dict(self) -> dict:
        """The fields as a plain dict (JSON-ready)."""
        return asdict(self)


def _derived_seed(*parts: int) -> int:
    """A 62-bit seed from integers, the same in every process and Python run."""
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 2


def _runs(prompts: list) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of equal consecutive prompts."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class RolloutFunc:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` that generates with a ``specengine.LLM``.

    Args:
        llm: the engine; its model must have the trainer model's parameter names and shapes
            (e.g. both loaded from ``specengine.models.loader.resolve_model(alias)``), and
            ``logprobs_mode="processed_logprobs"`` is what TRL expects (a warning otherwise).
        seed: base of the per-request seeds (default: the trainer's ``args.seed``).
        sync_weights: push ``trainer.model``'s weights when the global step changes (False:
            the engine keeps the weights it has, e.g. to measure generation alone).

    Attributes:
        history: one ``RolloutStats`` per call, in call order.
        num_weight_pushes: pushes done so far.

    Raises (from a call):
        TypeError: ``prompts`` is not a non-empty list, or the trainer's model is a PEFT model
            (merge the adapter first: the engine holds full weights).
        ValueError: a sampling setting the engine does not have (an unknown
            ``generation_kwargs`` key), a prompt
            too long for the engine, or a parameter name / shape the engine does not have.
    """

    def __init__(self, llm, seed: int | None = None, sync_weights: bool = True):
        if getattr(llm, "engine", None) is None or not hasattr(llm, "update_weights"):
            raise TypeError(f"llm must be a specengine.LLM, got {type(llm).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if trl.__version__ != TESTED_TRL_VERSION:
            warnings.warn(f"RolloutFunc was written against trl=={TESTED_TRL_VERSION}; "
                          f"trl {trl.__version__} is installed", RuntimeWarning, stacklevel=2)
        if getattr(llm.engine, "logprobs_mode", None) != "processed_logprobs":
            warnings.warn("RolloutFunc: the LLM returns raw logprobs; TRL expects those of "
                          "the distribution sampled from (LLM(logprobs_mode="
                          "'processed_logprobs'))", RuntimeWarning, stacklevel=2)
        self.llm = llm
        self.seed = seed
        self.sync_weights = sync_weights
        self.history: list[RolloutStats] = []
        self.num_weight_pushes = 0
        self._pushed_step: int | None = None
        self._calls_at_step: dict[int, int] = {}

    @property
    def weight_version(self) -> int:
        """The engine's ``weight_version`` when it has one, else the pushes done here."""
        version = getattr(self.llm, "weight_version", None)
        return self.num_weight_pushes if version is None else int(version)

    # ------------------------------------------------------------------ the hook

    def __call__(self, prompts: list, trainer) -> dict:
        """Generate one completion per entry of ``prompts`` for ``trainer``.

        Args:
            prompts: TRL's per-process prompts: strings or conversations (lists of
                ``{"role", "content"}`` dicts), each distinct prompt repeated in a run.
            trainer: the ``GRPOTrainer`` (read: ``model``, ``state.global_step``,
                ``accelerator``, ``processing_class``, sampling attributes, ``args``).

        Returns:
            ``prompt_ids`` (list of token-id lists, one per entry), ``completion_ids`` (the
            sampled ids, EOS included when the sample ended on it), ``logprobs`` (one float per
            completion token), ``finish_reason`` (``"stop"``/``"length"`` per entry) and
            ``weight_version`` (int per entry).
        """
        if not isinstance(prompts, list) or not prompts:
            raise TypeError(f"prompts must be a non-empty list, got {type(prompts).__name__}"
                            + (" (empty)" if isinstance(prompts, list) else ""))
        step = int(trainer.state.global_step)
        synced, sync_seconds = False, 0.0
        if self.sync_weights and step != self._pushed_step:
            sync_seconds = self.push_weights(trainer)
            self._pushed_step, synced = step, True
        call = self._calls_at_step.get(step, 0)
        self._calls_at_step = {step: call + 1}

        runs = _runs(prompts)
        requests, params = self.requests(prompts, runs, trainer, step, call)
        before = self.llm.get_metrics()
        t0 = time.perf_counter()
        outs = self.llm.generate(requests, params, use_tqdm=False)
        generate_seconds = time.perf_counter() - t0
        after = self.llm.get_metrics()

        version = self.weight_version
        result, forwards = _completions(outs, version)
        generated = after["generated_tokens"] - before["generated_tokens"]
        spec = after.get("spec_steps", 0) - before.get("spec_steps", 0)
        accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
        completion_tokens = sum(len(c) for c in result["completion_ids"])
        self.history.append(RolloutStats(
            step=step, num_prompts=len(runs), num_completions=len(prompts), synced=synced,
            sync_seconds=sync_seconds, generate_seconds=generate_seconds,
            weight_version=version, generated_tokens=generated, spec_steps=spec,
            accepted_tokens=accepted, tau=(accepted + spec) / spec if spec else None,
            tokens_per_forward=completion_tokens / forwards if forwards else 0.0))
        return result

    # ------------------------------------------------------------------ the parts

    def requests(self, prompts: list, runs: list[tuple[int, int]], trainer, step: int,
                 call: int) -> tuple[list[dict], list[SamplingParams]]:
        """One engine request per run ``(start, length)`` of identical prompts: its prompt ids
        (``tokenize``) and ``SamplingParams`` with ``n`` = the run's length and the seed
        derived from ``(seed, process index, step, call, run)``."""
        prompt_ids = self.tokenize(prompts, trainer)
        base = trainer.args.seed if self.seed is None else self.seed
        process = int(getattr(trainer.accelerator, "process_index", 0))
        requests, params = [], []
        for r, (start, length) in enumerate(runs):
            requests.append({"prompt_token_ids": prompt_ids[start]})
            params.append(self.sampling_params(
                trainer, n=length, seed=_derived_seed(base, process, step, call, r)))
        return requests, params

    def push_weights(self, trainer) -> float:
        """Copy the trainer model's parameters into the engine now (cast to the engine's
        dtype); returns the wall seconds it took.

        Raises:
            TypeError: the model is a PEFT model.
            ValueError: from ``LLM.update_weights``: a name or shape the engine lacks (nothing
                is changed then).
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(model, "peft_config", None) is not None:
            raise TypeError("RolloutFunc: the trainer's model is a PEFT model; the engine "
                            "holds full weights (merge the adapter before pushing)")
        t0 = time.perf_counter()
        self.llm.update_weights((name, p.detach()) for name, p in model.named_parameters())
        seconds = time.perf_counter() - t0
        self.num_weight_pushes += 1
        return seconds

    @staticmethod
    def tokenize(prompts: list, trainer) -> list[list[int]]:
        """Prompt token ids as ``GRPOTrainer._tokenize_prompts`` (TRL 1.16) makes them for a
        text-only model: conversations through ``processing_class.apply_chat_template`` with
        ``add_generation_prompt=True`` and the trainer's ``tools``, ``chat_template`` and
        ``chat_template_kwargs``; strings through ``processing_class(text=prompts)``."""
        tok = trainer.processing_class
        if is_conversational({"prompt": prompts[0]}):
            encoded = tok.apply_chat_template(
                conversation=prompts, tools=trainer.tools or None,
                chat_template=trainer.chat_template, add_generation_prompt=True, tokenize=True,
                return_dict=True, **trainer.chat_template_kwargs)
        else:
            encoded = tok(text=prompts)
        return [[int(t) for t in ids] for ids in encoded["input_ids"]]

    @staticmethod
    def sampling_params(trainer, n: int, seed: int) -> SamplingParams:
        """The engine's ``SamplingParams`` for the trainer's settings: ``temperature``,
        ``top_p``, ``top_k`` (None -> 0, off), ``min_p`` (None -> 0.0),
        ``max_completion_length`` as ``max_tokens``, ``repetition_penalty`` (passed only when
        not 1.0), then ``args.generation_kwargs`` over them (vLLM names), with ``logprobs=0``.

        Raises:
            ValueError: a setting the engine's ``SamplingParams`` does not have, named.
        """
        fields = set(SamplingParams.__dataclass_fields__)
        kw = {"n": n, "seed": seed, "logprobs": 0, "temperature": float(trainer.temperature),
              "top_p": float(trainer.top_p), "top_k": int(trainer.top_k or 0),
              "min_p": float(trainer.min_p or 0.0),
              "max_tokens": int(trainer.max_completion_length)}
        penalty = getattr(trainer, "repetition_penalty", 1.0)
        if penalty is not None and float(penalty) != 1.0:
            kw["repetition_penalty"] = float(penalty)
        extra = dict(getattr(trainer.args, "generation_kwargs", None) or {})
        unknown = sorted(k for k in extra if k not in fields or k.startswith("_")
                         or k in ("n", "logprobs"))
        if unknown:
            raise ValueError(f"generation_kwargs {unknown}: not settable on specengine's "
                             f"SamplingParams (settable: "
                             f"{sorted(f for f in fields - {'n', 'logprobs'} if f[0] != '_')})")
        kw.update(extra)
        return SamplingParams(**kw)


def _completions(outs: list, version: int) -> tuple[dict[str, list], int]:
    """TRL's per-entry lists from the engine's outputs (one entry per sample, in order):
    ``prompt_ids``, ``completion_ids``, ``logprobs`` (the sampled token's, per completion
    token), ``finish_reason``, ``weight_version``; and the target forwards the outputs took."""
    result: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [],
                               "finish_reason": [], "weight_version": []}
    forwards = 0
    for out in outs:
        forwards += out.metrics.get("target_forwards", 0)
        for sample in out.outputs:
            result["prompt_ids"].append(list(out.prompt_token_ids))
            result["completion_ids"].append(list(sample.token_ids))
            result["logprobs"].append(
                [lp[tok].logprob for tok, lp in zip(sample.token_ids, sample.logprobs)])
            result["finish_reason"].append(sample.finish_reason)
            result["weight_version"].append(version)
    return result, forwards


class RolloutLogger(TrainerCallback):
    """A ``transformers.TrainerCallback`` that joins each trainer log with the rollouts done
    since the previous one: one row per log (per step with ``logging_steps=1``).

    Row keys: ``step``, ``generate_seconds`` and ``sync_seconds`` (summed over the rollouts),
    ``generated_tokens``, ``tau`` (pooled: ``(accepted + spec_steps) / spec_steps``, None
    without speculation), ``weight_version`` (after the last rollout), and from the trainer's
    log ``reward`` (mean over the batch), ``reward_std`` and ``step_time`` (seconds; None when
    absent).

    Args:
        rollout: the ``RolloutFunc`` passed as ``rollout_func``.
        print_fn: called with one formatted line per row (None: silent).
    """

    def __init__(self, rollout: RolloutFunc, print_fn=print):
        self.rollout = rollout
        self.print_fn = print_fn
        self.rows: list[dict] = []
        self._seen = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Record a row when ``logs`` has a ``reward`` and rollouts happened since the last."""
        if not logs or "reward" not in logs:
            return
        new = self.rollout.history[self._seen:]
        self._seen = len(self.rollout.history)
        if not new:
            return
        spec = sum(h.spec_steps for h in new)
        accepted = sum(h.accepted_tokens for h in new)
        row = {"step": int(state.global_step),
               "generate_seconds": sum(h.generate_seconds for h in new),
               "sync_seconds": sum(h.sync_seconds for h in new),
               "generated_tokens": sum(h.generated_tokens for h in new),
               "tau": (accepted + spec) / spec if spec else None,
               "weight_version": new[-1].weight_version,
               "reward": float(logs["reward"]),
               "reward_std": float(logs["reward_std"]) if "reward_std" in logs else None,
               "step_time": float(logs["step_time"]) if "step_time" in logs else None}
        self.rows.append(row)
        if self.print_fn is not None:
            tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
            self.print_fn(f"step {row['step']}: generation {row['generate_seconds']:.2f} s "
                          f"({row['generated_tokens']} tokens), tau {tau}, "
                          f"reward {row['reward']:.3f}, weight version {row['weight_version']} "
                          f"(sync {row['sync_seconds']:.3f} s)")
