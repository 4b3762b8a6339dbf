// The steady-state replay step, natively: a memo of replay steps the Python
// runner took (graphmode/native/__init__.py says when and why).
//
// Contract: Memo.step() either does exactly what the Python path did for a
// step of the same layout (the same checks passing, the same copies, the
// same replay, the same output view) and returns the output, or does
// nothing and returns None, and the Python path takes the step (and raises
// its errors). It never raises an error of its own for a bad input.

// The headers it uses, not <torch/extension.h> (all of libtorch's C++ API): a build in a third of the time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_copy.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/core/Event.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <map>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

// input_ids, position_ids, then the AttnMetadata tensors every step passes.
constexpr int kTensors = 7;
constexpr int kMaxSlots = 8;  // at least graphmode.ring.SLOTS (the Memo refuses more)

struct Source {
  int index;   // into the step's tensors
  bool words;  // an int64 tensor copied as int32 words (graphmode.fill_words)
};

// One _foreach_copy_: the first sources.size() destinations take the step's
// tensors, the rest the constants (padding rows, table tails).
struct Group {
  std::vector<at::Tensor> destinations;
  std::vector<Source> sources;
  std::vector<at::Tensor> constants;
};

struct Entry {
  int64_t batch = 0, bucket = 0;
  int64_t kv_limit = 0;  // the largest max_kv_seq_len the Python checks pass unlooked at
  std::vector<py::object> leaves;  // the KV-cache tensors the graph captured
  std::vector<const void*> pointers;
  std::array<std::vector<Group>, kMaxSlots> programs;  // by host staging mirror (slot 0 without)
  std::array<bool, kMaxSlots> learned{};
  std::array<at::Tensor, kMaxSlots> arena, mirror;  // host staging: the views of the mirror's one copy
  py::object replay;
  at::Tensor output;
  py::object host_marks;  // the emulator's host marks of the step's tensors (None on a device)
};

using Key = std::vector<int64_t>;

bool is_int(PyObject* value, int64_t* out) {
  int overflow = 0;
  if (!PyLong_CheckExact(value)) return false;
  *out = PyLong_AsLongLongAndOverflow(value, &overflow);
  return overflow == 0;
}

// Host staging's mirrors on a CUDA device: graphmode.ring.Ring, in C++ (that
// module says why). Device-generic c10 calls: built without CUDA's headers.
class Ring {
 public:
  Ring(int slots, int group, int device_index)
      : slots_(slots), group_(group), slot_(slots - 1),
        device_(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)) {
    if (slots < 1 || slots > kMaxSlots || group < 1 || slots % group != 0)
      throw std::invalid_argument("Ring: slots must be 1 to 8 and a multiple of group");
    for (int i = 0; i < slots / group; ++i) events_.push_back(std::make_unique<c10::Event>(c10::DeviceType::CUDA));
    pending_.assign(events_.size(), false);
  }

  int next() const { return (slot_ + 1) % slots_; }

  // Whether begin() would return at once (the memo's step never waits with the GIL
  // held: it leaves a wait to the Python path, whose call of begin() releases it).
  bool ready() const {
    int slot = next();
    if (slot % group_ != 0) return true;
    int group = slot / group_;
    if (slot_ / group_ == group && pending_[group]) return false;  // one group: begin() records, then waits
    return events_[group]->query();  // true for an event never recorded
  }

  // Take the next mirror, once every copy launched from its group has run (wait false: ready() said so).
  int begin(bool wait = true) {
    int slot = next();
    if (slot % group_ == 0) {
      int left = slot_ / group_;
      if (pending_[left]) record(left);  // the group just left ended with a step stopped before its copy
      if (wait) events_[slot / group_]->synchronize();  // returns at once for an event never recorded
    }
    slot_ = slot;
    return slot_;
  }

  // The mirror's copy into the arena on the current stream; the group's event after its last.
  void copy(at::Tensor arena, const at::Tensor& mirror) {
    arena.copy_(mirror, /*non_blocking=*/true);
    pending_[slot_ / group_] = true;
    if (slot_ % group_ == group_ - 1) record(slot_ / group_);
  }

  void wait() {
    for (size_t group = 0; group < events_.size(); ++group) {
      if (pending_[group]) record(static_cast<int>(group));
      events_[group]->synchronize();
    }
  }

  int slot() const { return slot_; }

 private:
  void record(int group) {
    events_[group]->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device_));
    pending_[group] = false;
  }

  int slots_, group_, slot_;
  c10::Device device_;
  std::vector<std::unique_ptr<c10::Event>> events_;
  std::vector<bool> pending_;
};

// The model's parameters and buffers that the graphs captured, and their
// addresses then (graphmode.checks.weight_memory.WeightMemory holds it). A
// graph keeps reading the memory it captured, so a tensor given new memory
// since (param.data = new, tensor.set_(...)) leaves every replay reading the
// old: moved() finds it, in a loop of a few nanoseconds per tensor (the
// tensors are held, so the address is read from the same TensorImpl the
// model's Parameter object wraps; no Python object is touched).
class Addresses {
 public:
  void hold(std::vector<at::Tensor> tensors) {
    tensors_ = std::move(tensors);
    pointers_.clear();
    pointers_.reserve(tensors_.size());
    for (const auto& tensor : tensors_) pointers_.push_back(address(tensor));
  }

  void clear() {
    tensors_.clear();
    pointers_.clear();
  }

  // The index of the first held tensor whose memory moved since hold(), or -1.
  int64_t moved() const {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (address(tensors_[i]) != pointers_[i]) return static_cast<int64_t>(i);
    }
    return -1;
  }

  size_t size() const { return tensors_.size(); }

 private:
  // const_data_ptr (no copy-on-write materialisation); a tensor that lost its
  // storage reads as null, a move like any other (never an exception mid-step).
  static const void* address(const at::Tensor& tensor) {
    return tensor.unsafeGetTensorImpl()->has_storage() ? tensor.const_data_ptr() : nullptr;
  }

  std::vector<at::Tensor> tensors_;
  std::vector<const void*> pointers_;
};

class Memo {
 public:
  Memo(py::object attn_type, std::vector<std::string> names, py::object lock, py::object staging,
       py::object host_marks, py::object stats, py::object variant, py::object addresses)
      : attn_type_(attn_type), lock_(lock), staging_(staging), host_marks_(host_marks), stats_(stats),
        variant_(variant), addresses_object_(addresses) {
    if (!addresses_object_.is_none()) addresses_ = addresses_object_.cast<Addresses*>();
    for (const auto& name : names) names_.emplace_back(py::str(name));
    acquire_ = lock_.attr("acquire");
    release_ = lock_.attr("release");
    if (!staging_.is_none()) {
      ring_object_ = staging_.attr("ring");
      if (py::isinstance<Ring>(ring_object_)) {
        ring_ = ring_object_.cast<Ring*>();
      } else {  // the Python ring (the emulator)
        begin_ = ring_object_.attr("begin");
        copy_ = ring_object_.attr("copy");
      }
      slots_ = py::len(staging_.attr("mirrors"));
      if (slots_ > kMaxSlots) throw std::invalid_argument("Memo: more host staging mirrors than kMaxSlots");
    }
  }

  // Remember the replay step just taken by the Python path.
  void learn(py::handle input_ids, py::handle position_ids, py::handle attn, int64_t batch, int64_t bucket,
             int64_t kv_limit, py::list leaves, int slot, py::list groups, py::object replay, at::Tensor output,
             py::object host_marks, py::object copy_views) {
    std::array<py::object, kTensors> held;
    Key key;
    if (slot < 0 || slot >= kMaxSlots) throw std::invalid_argument("slot out of range");
    if (!layout(input_ids, position_ids, attn, held, key)) throw std::invalid_argument("not a step layout");
    std::shared_ptr<Entry>& owned = entries_[key];
    if (!owned) owned = std::make_shared<Entry>();
    Entry& entry = *owned;
    entry.batch = batch;
    entry.bucket = bucket;
    entry.kv_limit = kv_limit;
    entry.leaves.clear();
    entry.pointers.clear();
    for (auto leaf : leaves) {
      entry.leaves.push_back(py::reinterpret_borrow<py::object>(leaf));
      entry.pointers.push_back(THPVariable_Unpack(leaf.ptr()).const_data_ptr());
    }
    std::vector<Group> program;
    for (auto item : groups) {
      auto group = item.cast<py::tuple>();
      Group g;
      g.destinations = group[0].cast<std::vector<at::Tensor>>();
      for (auto [i, words] : group[1].cast<std::vector<std::pair<int, bool>>>()) g.sources.push_back({i, words});
      g.constants = group[2].cast<std::vector<at::Tensor>>();
      program.push_back(std::move(g));
    }
    entry.programs[slot] = std::move(program);
    entry.learned[slot] = true;
    if (!copy_views.is_none()) {
      std::tie(entry.arena[slot], entry.mirror[slot]) = copy_views.cast<std::pair<at::Tensor, at::Tensor>>();
    }
    entry.replay = replay;
    entry.output = output;
    entry.host_marks = host_marks;
  }

  // The step, or None: see the contract at the top.
  py::object step(py::handle input_ids, py::handle position_ids, py::handle past_key_values, py::handle attn) {
    if (entries_.empty() || Py_TYPE(attn.ptr()) != reinterpret_cast<PyTypeObject*>(attn_type_.ptr()))
      return py::none();
    c10::InferenceMode inference;  // as the Python path: buffers made in it are written in it
    std::array<py::object, kTensors> held;
    Key key;
    if (!layout(input_ids, position_ids, attn, held, key)) return py::none();
    auto found = entries_.find(key);
    if (found == entries_.end()) return py::none();
    std::shared_ptr<Entry> owned = found->second;  // alive through a reset() while the replay runs without the GIL
    Entry& entry = *owned;
    if (!scalars_pass(attn, entry) || !same_cache(past_key_values, entry)) return py::none();
    // A captured weight given new memory: the Python path refuses the step, naming it.
    if (addresses_ != nullptr && addresses_->moved() >= 0) return py::none();
    if (!host_marks_.is_none()) {  // the emulator: which tensors are host memory is part of the layout
      py::tuple tensors(kTensors);
      for (int i = 0; i < kTensors; ++i) tensors[i] = held[i];
      if (!host_marks_(tensors).equal(entry.host_marks)) return py::none();
    }
    int slot = 0;
    if (!staging_.is_none()) {
      slot = ring_ != nullptr ? ring_->next() : (ring_object_.attr("slot").cast<int>() + 1) % slots_;
    }
    if (!entry.learned[slot]) return py::none();
    // Every source before any effect: a view that cannot be made declines the step.
    std::vector<std::vector<at::Tensor>> sources;
    for (const Group& group : entry.programs[slot]) {
      std::vector<at::Tensor> list;
      list.reserve(group.destinations.size());
      for (const Source& source : group.sources) {
        const at::Tensor& tensor = THPVariable_Unpack(held[source.index].ptr());
        if (source.words && (tensor.dim() == 0 || tensor.stride(-1) != 1)) return py::none();
        list.push_back(source.words ? tensor.view(at::kInt) : tensor);
      }
      list.insert(list.end(), group.constants.begin(), group.constants.end());
      sources.push_back(std::move(list));
    }
    if (ring_ != nullptr && !ring_->ready()) return py::none();  // a wait: the Python path's, without the GIL
    if (!acquire_(false).cast<bool>()) return py::none();  // another step under way: the Python path says so
    struct Release {
      py::object& release;
      ~Release() { release(); }
    } unlock{release_};
    if (ring_ != nullptr) {
      ring_->begin(/*wait=*/false);
    } else if (!staging_.is_none()) {
      begin_();
    }
    for (size_t i = 0; i < sources.size(); ++i) {
      at::_foreach_copy_(entry.programs[slot][i].destinations, sources[i]);
    }
    if (ring_ != nullptr) {
      ring_->copy(entry.arena[slot], entry.mirror[slot]);
    } else if (!staging_.is_none()) {
      copy_(entry.arena[slot], entry.mirror[slot]);
    }
    entry.replay();
    count(entry);
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(entry.output.detach()));
  }

  // Replays this memo made (for tests and benchmarks; runner.stats counts every replay).
  int64_t replays() const { return replays_; }

  void clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

 private:
  // The step's tensors (held) and its layout key: every tensor's sizes,
  // dtype and device. False when one is missing or not a tensor.
  bool layout(py::handle input_ids, py::handle position_ids, py::handle attn, std::array<py::object, kTensors>& held,
              Key& key) {
    held[0] = py::reinterpret_borrow<py::object>(input_ids);
    held[1] = py::reinterpret_borrow<py::object>(position_ids);
    for (int i = 2; i < kTensors; ++i) {
      PyObject* value = PyObject_GetAttr(attn.ptr(), names_[i - 2].ptr());
      if (value == nullptr) {
        PyErr_Clear();
        return false;
      }
      held[i] = py::reinterpret_steal<py::object>(value);
    }
    key.clear();
    key.reserve(kTensors * 5 + 5);
    for (const auto& object : held) {
      if (!THPVariable_Check(object.ptr())) return false;
      describe(THPVariable_Unpack(object.ptr()), key);
    }
    // The host lengths' layout, when given (graphmode.checks.step_checks keys on it too).
    py::object host = attn.attr("kv_seqlens_cpu");
    if (host.is_none()) {
      key.push_back(-1);
    } else if (THPVariable_Check(host.ptr())) {
      describe(THPVariable_Unpack(host.ptr()), key);
    } else {
      return false;
    }
    return true;
  }

  static void describe(const at::Tensor& tensor, Key& key) {
    key.push_back(tensor.dim());
    for (int64_t size : tensor.sizes()) key.push_back(size);
    key.push_back(static_cast<int64_t>(tensor.scalar_type()));
    key.push_back(static_cast<int64_t>(tensor.device().type()));
    key.push_back(tensor.device().index());
  }

  // The runner's statistics, as the Python path keeps them (FullGraphs._replay),
  // through the C API: a few hundred nanoseconds of a step's host time.
  void count(const Entry& entry) {
    replays_ += 1;
    bump_attribute(replays_name_.ptr(), 1);
    bump_attribute(real_name_.ptr(), entry.batch);
    bump_attribute(padded_name_.ptr(), entry.bucket - entry.batch);
    bump_item(by_q_len_name_.ptr(), one_.ptr());  // Counters: a missing key counts 0
    bump_item(by_variant_name_.ptr(), variant_.ptr());
  }

  void bump_attribute(PyObject* name, int64_t more) {
    py::object value = steal(PyObject_GetAttr(stats_.ptr(), name));
    py::object sum = steal(PyNumber_Add(value.ptr(), py::int_(more).ptr()));
    if (PyObject_SetAttr(stats_.ptr(), name, sum.ptr()) != 0) throw py::error_already_set();
  }

  void bump_item(PyObject* counter_name, PyObject* key) {
    py::object counter = steal(PyObject_GetAttr(stats_.ptr(), counter_name));
    PyObject* value = PyDict_GetItemWithError(counter.ptr(), key);  // borrowed
    if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
    py::object sum = value == nullptr ? py::int_(1) : steal(PyNumber_Add(value, one_.ptr()));
    if (PyDict_SetItem(counter.ptr(), key, sum.ptr()) != 0) throw py::error_already_set();
  }

  static py::object steal(PyObject* object) {
    if (object == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(object);
  }

  // The usual decode step that graphmode.checks.step_checks passes without
  // further checks: int maxima, one token per sequence, the longest within
  // the table; host lengths only beside a known maximum that holds them
  // (check_values reads them against the table when it is unknown, against
  // it when known: graphmode.checks.host_lengths.check_kv_max_holds_host),
  // and a host-built step's kv_seqlens within a known maximum.
  bool scalars_pass(py::handle attn, const Entry& entry) {
    py::object decoding = attn.attr("is_decoding");
    if (decoding.ptr() != Py_True) return false;
    py::object q_max = attn.attr("max_q_seq_len");
    py::object kv_max = attn.attr("max_kv_seq_len");
    int64_t q = 0, kv = 0;
    if (!is_int(q_max.ptr(), &q) || q != 1 || !is_int(kv_max.ptr(), &kv) || kv > entry.kv_limit) return false;
    py::object host = attn.attr("kv_seqlens_cpu");
    if (host.is_none()) {
      // A step built on the host has its lengths there: they must hold too (check_kv_max_holds_host);
      // a CPU tensor that may be a device's (the emulator's) goes to the Python path, which knows.
      if (kv < 0) return true;
      py::object lens = attn.attr("kv_seqlens");
      if (!THPVariable_Check(lens.ptr())) return false;
      const at::Tensor& device_lens = THPVariable_Unpack(lens.ptr());
      return !device_lens.is_cpu() || longest_at_most(device_lens, kv);
    }
    return kv >= 0 && THPVariable_Check(host.ptr()) && longest_at_most(THPVariable_Unpack(host.ptr()), kv);
  }

  // Whether every value of a 1-D int32 or int64 host tensor is at most
  // `bound` (a loop over at most a batch of values: no dispatch); false for
  // any other tensor, which the Python path checks.
  static bool longest_at_most(const at::Tensor& host, int64_t bound) {
    if (host.dim() != 1 || !host.is_cpu()) return false;
    const int64_t count = host.size(0), stride = host.stride(0);
    if (host.scalar_type() == at::kInt) {
      const int32_t* values = host.const_data_ptr<int32_t>();
      for (int64_t i = 0; i < count; ++i) if (values[i * stride] > bound) return false;
      return true;
    }
    if (host.scalar_type() == at::kLong) {
      const int64_t* values = host.const_data_ptr<int64_t>();
      for (int64_t i = 0; i < count; ++i) if (values[i * stride] > bound) return false;
      return true;
    }
    return false;
  }

  // The cache tensors the graph captured, at the addresses it captured
  // (graphmode.checks.cache_checks.CacheMemory): a list or tuple of
  // per-layer lists or tuples.
  bool same_cache(py::handle past_key_values, const Entry& entry) {
    PyObject* cache = past_key_values.ptr();
    if (!PyList_CheckExact(cache) && !PyTuple_CheckExact(cache)) return false;
    size_t index = 0;
    Py_ssize_t layers = PySequence_Fast_GET_SIZE(cache);
    PyObject** items = PySequence_Fast_ITEMS(cache);
    for (Py_ssize_t layer = 0; layer < layers; ++layer) {
      PyObject* pair = items[layer];
      if (!PyList_CheckExact(pair) && !PyTuple_CheckExact(pair)) return false;
      Py_ssize_t count = PySequence_Fast_GET_SIZE(pair);
      PyObject** tensors = PySequence_Fast_ITEMS(pair);
      for (Py_ssize_t i = 0; i < count; ++i, ++index) {
        if (index >= entry.leaves.size() || tensors[i] != entry.leaves[index].ptr()) return false;
        if (THPVariable_Unpack(tensors[i]).const_data_ptr() != entry.pointers[index]) return false;
      }
    }
    return index == entry.leaves.size();
  }

  py::object attn_type_;
  std::vector<py::object> names_;
  py::object lock_, acquire_, release_;
  py::object staging_, ring_object_, begin_, copy_;
  Ring* ring_ = nullptr;
  int slots_ = 1;
  py::object host_marks_;
  py::object stats_, variant_;
  py::object addresses_object_;  // keeps addresses_ alive
  Addresses* addresses_ = nullptr;
  py::str replays_name_{"replays"}, real_name_{"real_tokens"}, padded_name_{"padded_tokens"};
  py::str by_q_len_name_{"replays_by_q_len"}, by_variant_name_{"replays_by_variant"};
  py::int_ one_{1};
  std::map<Key, std::shared_ptr<Entry>> entries_;
  int64_t replays_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  py::class_<Ring>(module, "Ring")
      .def(py::init<int, int, int>())
      .def("begin", &Ring::begin, py::arg("wait") = true, py::call_guard<py::gil_scoped_release>())
      .def("copy", &Ring::copy)
      .def("wait", &Ring::wait, py::call_guard<py::gil_scoped_release>())
      .def("ready", &Ring::ready)
      .def_property_readonly("slot", &Ring::slot);
  py::class_<Addresses>(module, "Addresses")
      .def(py::init<>())
      .def("hold", &Addresses::hold)
      .def("clear", &Addresses::clear)
      .def("moved", &Addresses::moved)
      .def("__len__", &Addresses::size);
  py::class_<Memo>(module, "Memo")
      .def(py::init<py::object, std::vector<std::string>, py::object, py::object, py::object, py::object, py::object,
                    py::object>())
      .def("learn", &Memo::learn)
      .def("step", &Memo::step)
      .def_property_readonly("replays", &Memo::replays)
      .def("clear", &Memo::clear)
      .def("__len__", &Memo::size);
}
