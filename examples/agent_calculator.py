"""A multi-turn agent rollout with a real tool (a calculator) through ``specengine serve``,
token in / token out.

Each GSM question is a conversation kept as token ids (``specengine.multiturn.Conversation``):
the server's ``/v1/completions`` gets the ids (``prompt`` as a list of ints) and returns the
sampled ids (``return_token_ids``) with their logprobs; when the reply ends in a calculator call
``<calc>EXPR</calc>``, the expression is evaluated (numbers and + - * / // % ** and
parentheses only) and the result is appended as a ``tool`` turn, tokenized alone; the history
is never re-tokenized. At the end each episode has the ids, the loss mask (1 on sampled
tokens) and the logprobs an RL trainer needs, and the reward (the last number of the final
reply against the GSM answer).

    specengine serve &          # default model; add --api-key KEY to require a key
    python examples/agent_calculator.py --url http://127.0.0.1:8000 --questions 4

The default 135M model rarely uses the tool; the loop is the same for any model.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
SYSTEM = ("Solve the problem step by step. To compute something, write <calc>EXPRESSION</calc> "
          "and stop; the result comes back as a tool message. End with 'Answer: NUMBER'.")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expr: str) -> str:
    """The value of an arithmetic expression, or ``"error: ..."``: only numbers, the binary
    operators + - * / // % ** (exponents up to 100) and unary + -, no names or calls."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")
    try:
        value = ev(ast.parse(expr.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def complete(url: str, ids: list[int], params: dict, api_key: str | None = None) -> dict:
    """One ``/v1/completions`` call with a token-id prompt; returns the choice (with
    ``token_ids``, ``text``, ``finish_reason`` and logprobs)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = requests.post(f"{url}/v1/completions", headers=headers, timeout=600, json={
        "model": params["model"], "prompt": ids, "return_token_ids": True, "logprobs": 0,
        "stop": ["</calc>"], "include_stop_str_in_output": True,
        **{k: v for k, v in params.items() if k != "model"}})
    r.raise_for_status()
    return r.json()["choices"][0]


def episode(tokenizer, question: str, generate, max_turns: int = 4) -> dict:
    """One agent rollout: ``generate(ids) -> choice`` until a reply without a calculator call
    or ``max_turns`` replies. Returns ``{"token_ids", "loss_mask", "logprobs", "turns",
    "tool_calls", "final_text"}``; ``logprobs`` has one value per id, 0.0 where the mask is 0."""
    from specengine.multiturn import Conversation

    conv = Conversation.start(tokenizer, [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": question}])
    logprobs = [0.0] * len(conv.token_ids)
    calls, text = 0, ""
    for turn in range(max_turns):
        choice = generate(conv.token_ids)
        ids, text = choice["token_ids"], choice["text"]
        conv.add_response(ids)
        lps = (choice.get("logprobs") or {}).get("token_logprobs") or [0.0] * len(ids)
        logprobs += list(lps)
        call = CALL.search(text)
        if call is None or turn == max_turns - 1:
            break
        calls += 1
        added = conv.add_messages([{"role": "tool", "content": calculate(call.group(1))}])
        logprobs += [0.0] * len(added)
    return {"token_ids": conv.token_ids, "loss_mask": conv.loss_mask, "logprobs": logprobs,
            "turns": turn + 1, "tool_calls": calls, "final_text": text}


def reward(text: str, answer: str) -> float:
    """1.0 when the last number in ``text`` equals the GSM answer, else 0.0."""
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    if not nums:
        return 0.0
    try:
        return float(float(nums[-1].replace(",", "")) == float(answer.replace(",", "")))
    except ValueError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="the model whose tokenizer the server uses (alias or directory)")
    ap.add_argument("--served-model-name", default=None,
                    help="the server's model name (default: --model)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the episodes as JSON lines here")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from specengine.data.prompt_sets import gsm_questions
    from specengine.models.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(a.model))
    params = {"model": a.served_model_name or a.model, "max_tokens": a.max_tokens,
              "temperature": 1.0, "seed": a.seed}
    episodes = []
    for i, q in enumerate(gsm_questions(a.questions, seed=a.seed)):
        ep = episode(tok, q["question"], lambda ids: complete(a.url, ids, params, a.api_key),
                     a.max_turns)
        ep["reward"] = reward(ep["final_text"], str(q["answer"]))
        episodes.append(ep)
        print(f"question {i}: {ep['turns']} turns, {ep['tool_calls']} calculator calls, "
              f"{len(ep['token_ids'])} ids ({sum(ep['loss_mask'])} sampled), "
              f"reward {ep['reward']}")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            for ep in episodes:
                f.write(json.dumps(ep) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
