"""Ask a running mmserve server about the sample scenes, with the OpenAI Python client.

Start the server first (with no model it serves the bundled demo model)::

    mmserve serve

then, from the repository root::

    python samples/client.py

Each sample image is sent inline as a data URL, with a request for a caption and one question.
The model id is taken from the server's model list, so this works whatever model it serves.
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

from openai import OpenAI

SAMPLES = Path(__file__).parent


def image_part(path: Path) -> dict:
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client: OpenAI, model: str, path: Path, question: str) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [image_part(path),
                                               {"type": "text", "text": question}]}],
        max_tokens=32,
        temperature=0,
    )
    return response.choices[0].message.content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if set")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    # scenes.json holds each sample's reference caption and answers.
    manifest = json.loads((SAMPLES / "scenes.json").read_text())
    for name, reference in manifest.items():
        path = SAMPLES / name
        caption = ask(client, model, path, "Describe this image.")
        count = ask(client, model, path, "How many shapes are there?")
        print(f"{name}: {caption} (how many shapes? {count})")
        if caption != reference["caption"]:
            print(f"    reference: {reference['caption']}")


if __name__ == "__main__":
    main()
