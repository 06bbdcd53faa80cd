"""Template parameters in, validated configuration and launch checks out: the one definition of every option."""
