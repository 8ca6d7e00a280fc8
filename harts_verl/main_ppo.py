"""``python -m harts_verl.main_ppo``: veRL PPO with tree-aware DP balancing (see
:mod:`harts_verl.workers.trainer`)."""

from harts_verl.workers.trainer import main

if __name__ == "__main__":
    main()
