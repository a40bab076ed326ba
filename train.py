"""Train a GPT: python train.py --config=configs/shakespeare_char_cpu.py [--config.KEY=VALUE ...]."""

from jaxgpt.cli.train import main

if __name__ == "__main__":
    main()
