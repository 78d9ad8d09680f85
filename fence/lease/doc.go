// Package lease fences a disk that has no SCSI-3 persistent reservations
// (virtio-blk, or a target without PR) with a lease kept on the disk
// itself. Its Engine implements fence.Fencer, so the agent picks it or the
// reservation engine (fence/pr) by probing, and handles both the same way.
// The algorithm is the delta lease of Chockler and Malkhi ("Light-Weight
// Leases for Storage-Centric Coordination") as sanlock uses it for host
// ids, extended with per-host slots and epochs so that each host only ever
// writes its own block; the code is ours.
//
// # On-disk layout
//
// The lease owns the first AreaSize (1 MiB) of a disk it formats; the
// volume's data starts at DataOffset (1 MiB). Every structure is one
// 4096-byte block (all I/O is O_DIRECT|O_DSYNC with 4096-aligned buffers,
// valid for 512- and 4096-byte logical sectors), big-endian, and ends in a
// CRC-32C of the block's first 4092 bytes:
//
//	block 0       header: "VCOLEASE", version 1, block size 4096, slot count 16,
//	              slot offset 4096, data offset 1048576, random volume id,
//	              format time, creator key
//	blocks 1..16  per-host slots: "VCOSLOT1", fence key, epoch, counter,
//	              writer's wall clock (informational), state (held, released,
//	              fenced), the writer's timing (ms), superseded key, node name;
//	              an all-zero block is an unused slot
//	rest of 1 MiB zero, reserved
//	from 1 MiB    the volume's data
//
// A host finds its slot by its fence key (the slot already carrying the
// key, else the first empty one in an order hashed from the key, never an
// empty FastSlot, which is kept for the fast first claim, else a
// released or fenced one of another key: its host may be claiming it
// again, and of two claims in one slot the later erases the earlier).
// Otherwise it writes another host's slot only once that host is gone: a
// slot waited out for its expiry bound (cleared, or reclaimed when every
// slot is used) or one copied from another disk. One read of ReadSize
// (68 KiB) sees the whole state.
//
// # Using the data area
//
// Anything the agent puts on the volume lives at DataOffset, seen through
// a mapping that starts there. MapData makes it a loop device with an
// offset (LOOP_CONFIGURE, lo_offset = DataOffset, no size limit, direct
// I/O, autoclear), which every Linux host has; where the agent has
// device-mapper it may use a dm-linear table over the same range instead.
// A filesystem is made on, and mounted from, that mapping; a LUKS2 volume
// puts its header at the start of the mapping (dm-crypt may also map the
// raw disk directly with its segment offset plus DataOffset); a raw block
// volume is the mapping itself. Online expansion grows the disk, then the
// mapping (Data.Resize: LOOP_SET_CAPACITY; or a dm table reload), then
// dm-crypt and the filesystem as usual; the lease area never moves,
// because it is at the start. FindData finds the mapping again after an
// agent restart. Tools run on the raw disk see our header and no
// filesystem, so nothing on the host mounts a lease volume by accident.
//
// # Algorithm
//
// The owner is the held slot with the highest epoch (lowest key on a tie).
//
// Acquire: read the area. If no slot is held, or the owner has released or
// fenced, the disk is free. If another key owns it, observe its slot, re-
// reading every renewal interval of that holder: any change means the
// holder is alive, and the disk is refused (fence.HeldError naming the
// holder) -- a live holder is refused within about one renewal interval;
// no change for the holder's Expiry bound means it is gone and may be
// taken over. Then write our slot (held, epoch = highest epoch + 1). If the
// read and this write together took longer than d, withdraw and start
// over (the race check needs our write to land within d of our read). A
// write that timed out may still land: start over as well, and the next
// read (which waits for the device's earlier requests) withdraws it if it
// landed; such a claim is never resumed as ours. Landed in a slot that
// did not carry our key, it may have erased the claim of a host that
// picked the same slot and holds the disk since its own check: the next
// acquisition waits that slot out for our expiry bound first. Wait
// Settle (2d), read again: our slot must still hold exactly what we wrote,
// we must be the owner, and an expired holder's slot must be unchanged;
// otherwise withdraw (mark our slot released) and refuse, naming the
// winner. Two hosts racing for a free disk both write epoch e+1 and both
// see both writes after 2d, so exactly one (the lower key) wins. Nodes
// may be configured with different timings: a racer with a shorter d
// settles sooner and may have checked its claim before ours landed, so a
// winner whose check finds another host's claim that landed since its
// read waits, as for a granted victim, until that host has let go
// (released, or fenced once its renewal saw our claim) or has not
// written for its expiry bound.
//
// Renew: every R, read the area, check that our slot holds our last write
// and that we still own the lease, and write the slot with the next
// counter. A renewal write that timed out may still land: until a read
// settles it, our slot may hold either our last confirmed write or that
// one (the late write does not move the fail deadline). Check does the
// same reads without the write.
//
// A slot whose bytes changed and do not decode is a write caught half
// landed: it counts as live everywhere, never as a release or an
// acknowledgement, and is waited for with the longer of the reader's
// expiry bound and the one its bytes still carry (its writer's). A taker
// waits for every held slot of another key (a host superseded by a claim
// it has not yet seen still writes); a slot written during that wait
// that was not waited for (a claim, perhaps caught half landed, whose
// epoch the taker cannot see) starts the acquisition over. It clears the
// slots it waited out once it holds the lease, and with every slot used
// reclaims one waited out for its expiry bound. A fresh record of
// our own is resumed only after a settle wait and a second read.
//
// Lose: a foreign owner above us, our slot changed, or no successful
// renewal for F (a timer fires at that deadline; while a renewal I/O is
// in flight, at most d later, which Expiry allows for) marks the claim
// lost for good (fence.LostError): renewals stop, Config.
// OnLost is called to stop I/O at once, and once it reports that every
// write of this host has completed or failed, our slot is marked fenced
// (past the read-only flag that stopped the I/O). The engine never
// acquires again; a new stage request makes a new Engine.
//
// Fast first claim: AcquireFirst (the controller says no node was given
// the disk before) on a lease area whose slots are all empty writes its
// claim to FastSlot and holds the disk once the claim has landed within
// FastClaimWithin of its read, without the settle wait: a host racing it
// (a platform that attached the disk to another VM too) never writes an
// empty FastSlot, and checks its own claim 2d >= 2 x MinIOTimeout after
// writing it, when ours has landed (docs/fencing.md).
//
// Release: stop renewing, mark our slot released (a write that timed out
// is tried again: no deadline runs against it). The next acquirer then
// needs only the 2d settle wait.
//
// # Grants
//
// A grant naming the owner's key (the controller says the cloud detached
// the disk from that VM) lets the taker write its claim at once instead of
// first observing the holder for the expiry bound; the grant cannot make
// the holder stop writing, so the taker still does not return until the
// holder has acknowledged (its slot says fenced or released: its agent saw
// our higher epoch at its next renewal and stopped I/O) or its slot has
// been unchanged for the full expiry bound. A live, healthy holder thus
// lets go within about one renewal interval; a dead or frozen one costs
// the same wait as without a grant, as in sanlock. A grant that names
// another key is treated as no grant.
//
// # Timing
//
// Every parameter is in Timing and written into the holder's slot, so a
// taker waits for the holder's bound. Defaults (DefaultTiming):
//
//	d  IOTimeout   2s    bound on one lease read or write
//	R  Renew       4s    renewal interval (2d)
//	F  Fail       20s    self-fence after no successful renewal for F (5R)
//	W  Watchdog   30s    host watchdog reset time after its last feed (agent/watchdog)
//	Expiry  max(F+W+d, R+6d) = 52s   observation without change before takeover
//	Settle  2d = 4s                  wait between writing a claim and checking it
//
// Acquiring a free disk takes Settle plus two reads and a write (a fast
// first claim the reads and the write without the wait); a held one is
// refused within about R + d; an expired one is taken after Expiry plus
// Settle, 56s; a live holder superseded by a grant has let go within
// max(2d, R) + d/2 plus its drain (Timing.Bounds; the benchmarks in this
// package measure the takeovers against these bounds).
//
// # Guarantees
//
// Given that every lease I/O either completes within d or is abandoned,
// that the hosts' monotonic clocks run at about the same rate, and that
// the holder stops its I/O within F of its last successful renewal, two
// hosts never both hold the lease at the same time, and a host that loses
// it finds out and says so.
//
// What it cannot give: the storage target does not enforce the lease. A
// holder whose agent hangs or is killed, or whose VM is frozen, keeps its
// filesystem's writes flowing until something stops them; safety then
// rests on the holder's host watchdog resetting the host within W of its
// last feed. The agent arms one while it holds any lease and feeds it only
// while every lease's last renewal is younger than F - d or the lease was
// fenced (agent/watchdog; Engine.Health gives that state without the
// engine's lock). A VM frozen longer than the expiry bound can still issue writes
// queued before the freeze after it resumes. Only SCSI-3 reservations
// (fence/pr) are enforced by the target.
//
// # Foreign disks
//
// Format writes a lease area only on a disk whose first and last MiB are
// zeros and on which neither our signature checks (blkid-style magics:
// filesystems, LUKS, partition tables, LVM, MD, swap) nor `blkid -p` find
// anything; it never writes over data (docs/architecture.md P5) and leaves an
// existing lease area alone. A disk with a foreign layout and no PR has no
// fencing at all; staging it is the volume's explicit opt-in, which the
// agent logs.
package lease
