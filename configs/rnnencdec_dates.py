"""rnnencdec on dates: the shared recurrent settings of configs/recurrent.py.

python train.py --config=configs/rnnencdec_dates.py --workdir=runs/rnnencdec_dates
"""

from configs import recurrent


def get_config():
    return recurrent.get_config("rnnencdec", "dates")
