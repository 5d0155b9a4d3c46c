"""Any PyTorch training loop publishing its model through deltamesh: three lines of the loop are deltamesh's.

    python examples/publish_loop.py --config publish.toml --token-file trainer.token --steps 3

`publish.toml` holds the `[publish]` table (docs/API.md, "Publishing from a training loop"): the origin
gateway's URL, the model id, the trainer's signing key, TLS settings for an https:// gateway; the
trainer's token comes from `--token-file` (or $DELTAMESH_TOKEN), never from the file. The model is a
small MLP trained to reproduce its input: after every optimizer step its weights are published as the
next version (the first a full snapshot, then signed deltas), which the origin relays to every region.
"""

from __future__ import annotations

import argparse
import logging

import torch

from deltamesh.logs import setup_logging
from deltamesh.trainer import WeightPublisher

log = logging.getLogger("publish_loop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TOML file with a [publish] table")
    parser.add_argument("--token-file", default=None, help="file holding the trainer's token")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    setup_logging()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with WeightPublisher.from_file(args.config, token_file=args.token_file) as publisher:  # 1: open
        for step in range(args.steps):
            x = torch.randn(32, 64)
            loss = torch.nn.functional.mse_loss(model(x), x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            published = publisher.publish(model)  # 2: the next version, signed, at the origin on return
            log.info("step %d: loss %.4f, published v%d (%s, %d bytes)", step, loss.item(), published.version,
                     "+".join(m.kind for m in published.manifests), published.bytes_sent)
    # 3: leaving the `with` closes the publisher's connections


if __name__ == "__main__":
    main()
