import pytest

import rlnb


def test_a():
    with pytest.raises(rlnb.ClusterError, match="expected a positive"):
        rlnb.Cluster(slots=0)
