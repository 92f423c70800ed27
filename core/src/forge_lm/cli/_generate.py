"""``forge generate RUN_OR_CHECKPOINT --prompt TEXT [--image PATH ...]``: sample text from a
trained model, prompted with images too when the model takes them."""

from __future__ import annotations

from typing import Any

HELP = "sample text from a checkpoint (temperature, top-k, top-p; KV cache; images for a vision-language run)"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory or checkpoints/step_<N>")
    parser.add_argument("--prompt", default="", help="text to continue (default: empty)")
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help=(
            "an image file for a vision-language run (repeatable, in order); read, resized and normalised as "
            "the run's data reads images. Each image goes where the prompt holds an <image> marker (one marker "
            "per image); one image with no marker goes before the prompt"
        ),
    )
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

        model, config, tokenizer = load_for_inference(args.checkpoint, plugins())
    if args.image:
        prompt, inputs = _image_prompt(model, args, tokenizer, config)
        shown = len(prompt)  # the prompt's text is printed as given, its image tokens not at all
    else:
        prompt, inputs = tokenizer.encode(args.prompt) or [tokenizer.eos_id], {}
        shown = len(prompt) if args.prompt else 1
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
            inputs=inputs,
        )
    print(args.prompt + tokenizer.decode(tokens[shown:]))
    return 0


def _image_prompt(model: Any, args: Any, tokenizer: Any, config: Any) -> tuple[list[int], dict[str, Any]]:
    """The prompt's ids and the forward's image arguments, from the model's plugin
    (:class:`forge_lm.components.PromptsWithImages`); what it returns is checked."""
    import torch

    from forge_lm.components import PromptsWithImages
    from forge_lm.errors import ForgeError, PluginError

    family = config.model.name
    if not isinstance(model, PromptsWithImages):
        raise ForgeError(
            f"--image: the model of '{args.checkpoint}' ([model] name = '{family}', {type(model).__name__}) takes "
            "no images; leave --image out, or give a vision-language run (forge-vlm's llava)."
        )
    answer = model.image_prompt(args.prompt, list(args.image), tokenizer, config)
    ok = isinstance(answer, tuple) and len(answer) == 2
    ids, inputs = answer if ok else (None, None)
    ok = ok and isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids) and ids
    ok = ok and isinstance(inputs, dict) and all(isinstance(v, torch.Tensor) for v in inputs.values())
    if not ok:
        raise PluginError(
            f"the '{family}' model's image_prompt returned {type(answer).__name__}, not (a non-empty list of token "
            "ids, a dict of tensors); this is a bug in the model family's plugin."
        )
    return ids, inputs
