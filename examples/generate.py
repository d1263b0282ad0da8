"""Generate text with hf2q_mlx: load a model, continue a prompt, print the result.

    python examples/generate.py                        # the Gemma 3 270M demo model
    python examples/generate.py --model model.gguf --prompt "The three primary colors are"

The demo model is the pretrained (base) Gemma 3 270M: it continues text, so the prompt is a
plain string. For an instruction-tuned model pass a list of chat messages instead (chat.py).
"""

import argparse

import hf2q_mlx

parser = argparse.ArgumentParser(description="Continue a prompt with hf2q_mlx.")
parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: demo)")
parser.add_argument("--prompt", default="The Eiffel Tower is located in the city of")
parser.add_argument("--max-tokens", type=int, default=48)
args = parser.parse_args()

# no path loads the demo model, assembled once into ~/.cache/hf2q_mlx
model, tokenizer = hf2q_mlx.load(args.model)

text = hf2q_mlx.generate(
    model,
    tokenizer,
    args.prompt,  # a string: encoded as is (with BOS), no chat template
    max_tokens=args.max_tokens,
    temperature=0.0,  # greedy: the same text every run
)
print(args.prompt + text)
