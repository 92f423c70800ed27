"""``forge generate RUN_OR_CHECKPOINT --prompt TEXT``: sample text from a trained model."""

from __future__ import annotations

HELP = "sample text from a checkpoint (temperature, top-k, top-p; KV cache)"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory or checkpoints/step_<N>")
    parser.add_argument("--prompt", default="", help="text to continue (default: empty)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    from forge_lm.cli._status import working

    with working(f"loading torch and the model of {args.checkpoint}"):  # seconds before any output
        import torch

        from forge_lm.model.generate import generate
        from forge_lm.train.inference import load_for_inference

        model, _, tokenizer = load_for_inference(args.checkpoint, plugins())
    prompt = tokenizer.encode(args.prompt) or [tokenizer.eos_id]
    with working(f"generating up to {args.max_new_tokens} tokens"):
        tokens = generate(
            model,
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_id=tokenizer.eos_id,
            generator=torch.Generator().manual_seed(args.seed),
        )
    print(args.prompt + tokenizer.decode(tokens[len(prompt) if args.prompt else 1 :]))
    return 0
