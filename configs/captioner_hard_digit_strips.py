"""Show, Attend and Tell with hard (stochastic) attention (Xu et al. 2015, section 4.1) on
`digit_strips`: configs/captioner_digit_strips.py's settings, trained with the paper's
REINFORCE rule (a moving-average baseline, an entropy bonus, and half the images on the
expected context), for 4/3 of the steps: its gradient estimate is noisier, and it leaves chance
level later (about step 1500 against 300 for soft attention).

    python train.py --config=configs/captioner_hard_digit_strips.py --workdir=runs/captioner_hard_digit_strips
"""

from configs import captioner_digit_strips


def get_config():
    config = captioner_digit_strips.get_config(attention="hard")
    # lambda_r = 0.1: at 1, the REINFORCE term's gradient, large and noisy while the captions are
    # still guesses, drowns the likelihood's in the CNN: runs stay at chance for 2000 steps, and two
    # end at 0.35 and 0.84 exact match (an observation on digit_strips; see docs/performance.md).
    config.model.reinforce_weight = 0.1
    config.num_train_steps = 4_000
    config.eval_every_steps = config.checkpoint_every_steps = 2_000
    return config
