"""Solutions to lesson 06's exercises (for instructors; handed out after the workshop)."""


def my_predictions() -> dict:
    return {
        "A": "rejected",  # unmanaged + overlap_comm at ZeRO-1: reduction hooks need the boundary
        "B": "accepted",  # ZeRO-3 reduces in every backward() anyway (the message says stage 2)
        "C": "silently wrong",  # N = 3 but backward() still divides by GAS = 2
        "D": "silently wrong",  # the string "false" is truthy: DeepSpeed runs managed
        "E": "rejected",  # a second owner of the boundary, refused at the call
        "F": "accepted",  # uneven N, normalized by the global count: right
        "G": "silently wrong",  # right gradients at ZeRO-1, but global_samples stays 0
        "H": "rejected",  # any "amp" block is refused since Apex was removed
    }


def refused_at_initialize(config: dict) -> bool:
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    unmanaged = config.get("managed_gradient_accumulation", True) is False
    optimizer = config.get("optimizer", {})
    if "amp" in config:
        return True
    if "max_grad_norm" in optimizer.get("params", {}):
        return True
    if stage >= 1 and optimizer.get("type") == "SGD":
        return not config.get("zero_allow_untested_optimizer", False)
    overlap = zero.get("overlap_comm", stage == 3)  # DeepSpeed's default: on at stage 3 only
    if unmanaged and overlap and stage < 2:
        return True
    return unmanaged and config.get("compile", {}).get("deepcompile", False)


if __name__ == "__main__":
    from gas_lab.lessons.exercises.lesson06 import check_predictions, check_refusal_rules

    print(check_predictions(my_predictions))
    print(check_refusal_rules(refused_at_initialize))
