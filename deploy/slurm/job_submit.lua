--[[
Stagehand's check at submit for Slurm's job_submit/lua (JobSubmitPlugins=lua): a job whose #BB_LUA
directives name a project its user, group or account may not stage (the `allow` lines of
stagehand-slurm.conf; see stagehand_slurm.lua) is refused, and sbatch prints why:

  sbatch: error: stagehand: line 2 (#BB_LUA stage ... project=labb): user alice, uid 1001, gid 1001,
  account demo may not stage project 'labb' (/etc/slurm/stagehand-slurm.conf allows this job: demo)

On Slurm 22.05 this is the only check at submit (burst_buffer/lua's job_process sees no user
there); on 23.02+ burst_buffer.lua refuses the job at submit itself, and this script is optional.
Either way, data_in checks again before anything is staged.

A site with its own job_submit.lua calls Stagehand's check from it instead of installing this one:

  local stagehand_slurm = dofile("/etc/slurm/stagehand_slurm.lua")
  -- in slurm_job_submit(job_desc, part_list, submit_uid):
  local why = stagehand_slurm.job_submit_check("/etc/slurm", job_desc)
  if why then slurm.log_user("%s", why) return slurm.ESLURM_ACCESS_DENIED end
--]]

local script_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."

local stagehand_slurm = dofile(script_dir .. "/stagehand_slurm.lua")

function slurm_job_submit(job_desc, part_list, submit_uid)
	local why = stagehand_slurm.job_submit_check(script_dir, job_desc)
	if why then
		slurm.log_user("%s", why)
		return slurm.ESLURM_ACCESS_DENIED
	end
	return slurm.SUCCESS
end

-- A job's account may change while it waits (`scontrol update JobId=… Account=…`): the job's
-- directives are checked against the new one. Slurm shows no message for a refused update
-- ("Access/permission denied"); the reason goes to slurmctld's log.
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	if job_desc.account == nil or job_rec.burst_buffer == nil then
		return slurm.SUCCESS
	end
	local why = stagehand_slurm.job_submit_check(script_dir, {
		burst_buffer = job_rec.burst_buffer,
		user_id = job_rec.user_id,
		user_name = job_rec.user_name,
		group_id = job_rec.group_id,
		account = job_desc.account,
	})
	if why then
		slurm.log_info("stagehand: job %s: account %s refused: %s", tostring(job_rec.job_id), job_desc.account, why)
		return slurm.ESLURM_ACCESS_DENIED
	end
	return slurm.SUCCESS
end
