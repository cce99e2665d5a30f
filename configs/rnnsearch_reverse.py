"""rnnsearch on reverse: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/rnnsearch_reverse.py --workdir=runs/rnnsearch_reverse
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("rnnsearch", "reverse")
