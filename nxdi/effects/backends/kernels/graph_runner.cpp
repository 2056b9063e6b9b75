// A run of a bound program's graph, called op by op from C++ (`cpu_runner.run_in_cpp`).
//
// Why: a decode step of the 1.1B shape is about 290 graph nodes, and calling each from the
// graph's Python code costs a few microseconds of interpreter and argument parsing on top of the
// dispatcher: about 1 ms of a 30-48 ms step (docs/cpu-backend.md, "Graph runs in C++"). Here
// each node is one `callBoxed` on a stack of values the runner keeps.
//
// The program is a flat list of int64 instructions, made and checked in Python:
//   CALL  0, op, n_args, args..., n_rets, ret slots...   (a ret slot of -1 drops that value)
//         an arg is  0, slot  |  1, constant  |  2, n, slots...  (Tensor[])
//                    |  3, n, slots or -1...  (Tensor?[], -1 for None)  |  4  (an empty list)
//   ITEM  1, list slot, index, slot                        (an element of an op's list result)
//   FREE  2, slot                                          (after its last use)
// Slots 0..held-1 are the tensors bound at construction (weights, folded constants), the next
// n_inputs the tensors of each call, the rest the values the calls make. Constants arrive as
// Python values (ints, floats, lists, dtypes as ints, None) and are coerced once to the types
// their op's schema declares; a value that cannot be is refused at construction, naming the op.
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

enum Kind : int64_t { kCall = 0, kItem = 1, kFree = 2 };
enum ArgKind : int64_t { kSlot = 0, kConstant = 1, kTensors = 2, kOptionalTensors = 3, kEmptyList = 4 };

struct Arg {
  int64_t kind;
  int64_t value;               // slot or index into `constants_`
  std::vector<int64_t> slots;  // kTensors / kOptionalTensors
};

struct Step {
  int64_t kind;
  std::optional<c10::OperatorHandle> op;
  std::vector<Arg> args;
  std::vector<int64_t> rets;
  int64_t a = 0, b = 0, c = 0;  // ITEM: list slot, index, slot; FREE: slot
};

c10::IValue coerce(const c10::IValue& v, const c10::TypePtr& declared, const std::string& where) {
  c10::TypePtr t = declared;
  if (auto opt = t->cast<c10::OptionalType>()) {
    if (v.isNone()) return v;
    t = opt->getElementType();
  }
  if (t->kind() == c10::TypeKind::TensorType && (v.isInt() || v.isDouble() || v.isBool())) {
    // A number where a tensor goes: what torch's Python binding passes (a wrapped number, so
    // type promotion treats it as a scalar).
    at::Tensor wrapped = c10::scalar_to_tensor(v.toScalar());
    wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
    return wrapped;
  }
  if (t->kind() == c10::TypeKind::FloatType && v.isInt()) return c10::IValue(static_cast<double>(v.toInt()));
  if (t->kind() == c10::TypeKind::SymIntType && v.isInt()) return v;  // static shapes: plain ints
  if (auto list = t->cast<c10::ListType>(); list && v.isList()) {  // element by element, typed
    const c10::TypePtr elem = list->getElementType();
    c10::impl::GenericList out(elem->kind() == c10::TypeKind::SymIntType ? c10::IntType::get() : elem);
    for (const c10::IValue& e : v.toListRef()) out.push_back(coerce(e, elem, where));
    return out;
  }
  if (t->kind() == c10::TypeKind::NumberType && (v.isInt() || v.isDouble() || v.isBool())) return v;  // Scalar
  TORCH_CHECK(v.type()->isSubtypeOf(*t), where, ": a constant of type ", v.type()->repr_str(),
              " where the schema declares ", declared->repr_str());
  return v;
}

struct GraphRunner : torch::CustomClassHolder {
  std::vector<c10::IValue> held_;
  int64_t n_inputs_;
  int64_t n_slots_;
  std::vector<c10::IValue> constants_;
  std::vector<Step> steps_;
  std::vector<int64_t> outputs_;

  GraphRunner(std::vector<std::string> names, std::vector<std::string> overloads, std::vector<int64_t> code,
              c10::List<c10::IValue> constants, std::vector<at::Tensor> held, int64_t n_inputs, int64_t n_slots,
              std::vector<int64_t> outputs)
      : n_inputs_(n_inputs), n_slots_(n_slots), outputs_(std::move(outputs)) {
    TORCH_CHECK(names.size() == overloads.size(), "GraphRunner: one overload per op name");
    for (const at::Tensor& t : held) held_.emplace_back(t);
    const int64_t first_made = static_cast<int64_t>(held_.size()) + n_inputs_;
    TORCH_CHECK(first_made <= n_slots_, "GraphRunner: fewer slots than held values and inputs");
    std::vector<c10::OperatorHandle> ops;
    for (size_t i = 0; i < names.size(); ++i) {
      ops.push_back(c10::Dispatcher::singleton().findSchemaOrThrow(names[i].c_str(), overloads[i].c_str()));
    }
    auto slot = [&](int64_t s, bool may_be_none) {
      TORCH_CHECK((may_be_none && s == -1) || (0 <= s && s < n_slots_), "GraphRunner: slot ", s, " out of range");
      return s;
    };
    auto made = [&](int64_t s) {  // a call's results never overwrite a held value or an input
      TORCH_CHECK(s == -1 || s >= first_made, "GraphRunner: slot ", s, " is held or an input, not made by a call");
      return s;
    };
    size_t pc = 0;
    auto next = [&]() {
      TORCH_CHECK(pc < code.size(), "GraphRunner: the program ends inside an instruction");
      return code[pc++];
    };
    while (pc < code.size()) {
      Step step;
      step.kind = next();
      if (step.kind == kCall) {
        const int64_t op = next();
        TORCH_CHECK(0 <= op && op < static_cast<int64_t>(ops.size()), "GraphRunner: op ", op, " out of range");
        step.op = ops[op];
        const auto& schema = step.op->schema();
        const std::string where = "GraphRunner: " + schema.operator_name().name + "." +
                                  schema.operator_name().overload_name;
        const int64_t n_args = next();
        TORCH_CHECK(n_args == static_cast<int64_t>(schema.arguments().size()), where, ": ", n_args,
                    " arguments where the schema has ", schema.arguments().size());
        for (int64_t i = 0; i < n_args; ++i) {
          Arg arg{next(), 0, {}};
          if (arg.kind == kSlot) {
            arg.value = slot(next(), false);
          } else if (arg.kind == kConstant) {
            const int64_t c = next();
            TORCH_CHECK(0 <= c && c < static_cast<int64_t>(constants.size()), where, ": constant ", c, " out of range");
            arg.value = static_cast<int64_t>(constants_.size());
            constants_.push_back(coerce(constants.get(c), schema.arguments()[i].type(),
                                        where + " argument " + schema.arguments()[i].name()));
          } else if (arg.kind == kEmptyList) {  // Python cannot pass one untyped: typed here
            arg.kind = kConstant;
            arg.value = static_cast<int64_t>(constants_.size());
            constants_.push_back(coerce(c10::impl::GenericList(c10::AnyType::get()), schema.arguments()[i].type(),
                                        where + " argument " + schema.arguments()[i].name()));
          } else if (arg.kind == kTensors || arg.kind == kOptionalTensors) {
            const int64_t n = next();
            for (int64_t j = 0; j < n; ++j) arg.slots.push_back(slot(next(), arg.kind == kOptionalTensors));
          } else {
            TORCH_CHECK(false, where, ": unknown argument kind ", arg.kind);
          }
          step.args.push_back(std::move(arg));
        }
        const int64_t n_rets = next();
        TORCH_CHECK(n_rets == static_cast<int64_t>(schema.returns().size()), where, ": ", n_rets,
                    " results where the schema has ", schema.returns().size());
        for (int64_t i = 0; i < n_rets; ++i) step.rets.push_back(made(slot(next(), true)));
      } else if (step.kind == kItem) {
        step.a = slot(next(), false);
        step.b = next();
        step.c = made(slot(next(), false));
      } else if (step.kind == kFree) {
        step.a = slot(next(), false);
        TORCH_CHECK(step.a >= static_cast<int64_t>(held_.size()), "GraphRunner: a held value cannot be freed");
      } else {
        TORCH_CHECK(false, "GraphRunner: unknown instruction ", step.kind);
      }
      steps_.push_back(std::move(step));
    }
    for (int64_t o : outputs_) slot(o, false);
  }

  // The values of `outputs_` after running every step on `inputs` (the n_inputs tensors of a call).
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == n_inputs_, "GraphRunner.run: ", inputs.size(),
                " inputs where the program takes ", n_inputs_);
    const int64_t held = static_cast<int64_t>(held_.size());
    std::vector<c10::IValue> slots(static_cast<size_t>(n_slots_ - held));
    for (int64_t i = 0; i < n_inputs_; ++i) slots[i] = std::move(inputs[i]);
    auto value = [&](int64_t s) -> const c10::IValue& { return s < held ? held_[s] : slots[s - held]; };
    torch::jit::Stack stack;
    stack.reserve(16);
    for (const Step& step : steps_) {
      if (step.kind == kCall) {
        for (const Arg& arg : step.args) {
          if (arg.kind == kSlot) {
            stack.push_back(value(arg.value));
          } else if (arg.kind == kConstant) {
            stack.push_back(constants_[arg.value]);
          } else if (arg.kind == kTensors) {
            c10::List<at::Tensor> list;
            list.reserve(arg.slots.size());
            for (int64_t s : arg.slots) list.push_back(value(s).toTensor());
            stack.emplace_back(std::move(list));
          } else {
            c10::List<std::optional<at::Tensor>> list;
            list.reserve(arg.slots.size());
            for (int64_t s : arg.slots) {
              list.push_back(s < 0 ? std::nullopt : std::optional<at::Tensor>(value(s).toTensor()));
            }
            stack.emplace_back(std::move(list));
          }
        }
        step.op->callBoxed(stack);
        for (size_t i = 0; i < step.rets.size(); ++i) {
          if (step.rets[i] >= 0) slots[step.rets[i] - held] = std::move(stack[i]);
        }
        stack.clear();
      } else if (step.kind == kItem) {
        c10::IValue item = value(step.a).toListRef().at(step.b);
        slots[step.c - held] = std::move(item);
      } else {
        slots[step.a - held] = c10::IValue();
      }
    }
    std::vector<at::Tensor> out;
    out.reserve(outputs_.size());
    for (int64_t o : outputs_) out.push_back(value(o).toTensor());
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi_kernels, m) {
  m.class_<GraphRunner>("GraphRunner")
      .def(torch::init<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>,
                       c10::List<c10::IValue>, std::vector<at::Tensor>, int64_t, int64_t, std::vector<int64_t>>())
      .def("run", &GraphRunner::run);
}
